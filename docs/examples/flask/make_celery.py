"""``celery -A make_celery worker`` and ``celery -A make_celery zdelay``."""

from shop import create_app

flask_app = create_app()
celery_app = flask_app.extensions["celery"]
