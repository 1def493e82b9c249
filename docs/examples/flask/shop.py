"""A Flask shop whose unpaid orders are cancelled after ``ORDER_TIMEOUT`` seconds.

The app factory pattern of Flask's Celery guide, with celery-zdelay:
``celery_init_app`` makes the Celery app from ``app.config["CELERY"]`` and
gives its tasks ``apply_delayed`` and Flask's application context.
"""

from __future__ import annotations

import sqlite3
from typing import Any

from celery import Celery, shared_task
from flask import Blueprint, Flask, abort, current_app, g

import celery_zdelay


def create_app(test_config: dict[str, Any] | None = None) -> Flask:
    app = Flask(__name__)
    app.config.from_mapping(
        DATABASE="shop.sqlite3",
        ORDER_TIMEOUT=1800,  # seconds an order may stay unpaid
        CELERY={
            "broker_url": "redis://localhost:6379/0",
            "result_backend": "redis://localhost:6379/0",
            "task_ignore_result": True,
            # Parked tasks live in the broker's Redis unless zdelay_redis_url
            # names another one (it must, when the broker is RabbitMQ).
        },
    )
    # FLASK_DATABASE=..., FLASK_CELERY__broker_url=... override the defaults.
    app.config.from_prefixed_env()
    if test_config is not None:
        app.config.update(test_config)
    celery_init_app(app)
    app.teardown_appcontext(close_db)
    app.register_blueprint(orders)
    with app.app_context():
        init_db()
    return app


def celery_init_app(app: Flask) -> Celery:
    class FlaskTask(celery_zdelay.Task):
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            with app.app_context():
                return self.run(*args, **kwargs)

    celery_app = Celery(app.name, task_cls=FlaskTask)
    celery_app.config_from_object(app.config["CELERY"])
    celery_app.set_default()
    app.extensions["celery"] = celery_app
    return celery_app


# -- the database -------------------------------------------------------------


def get_db() -> sqlite3.Connection:
    if "db" not in g:
        g.db = sqlite3.connect(current_app.config["DATABASE"], isolation_level=None)
        g.db.row_factory = sqlite3.Row
    return g.db


def close_db(exc: BaseException | None = None) -> None:
    db = g.pop("db", None)
    if db is not None:
        db.close()


def init_db() -> None:
    get_db().execute(
        "CREATE TABLE IF NOT EXISTS orders ("
        " id INTEGER PRIMARY KEY, status TEXT NOT NULL, timer TEXT)"
    )


# -- the task -------------------------------------------------------------------


@shared_task(name="flask_shop.cancel_unpaid")
def cancel_unpaid(order_id: int) -> None:
    # Re-check in the database: the payment may have landed at the last moment.
    get_db().execute(
        "UPDATE orders SET status = 'cancelled' WHERE id = ? AND status = 'unpaid'",
        (order_id,),
    )


# -- the views ------------------------------------------------------------------

orders = Blueprint("orders", __name__)


@orders.post("/orders")
def create_order() -> tuple[dict[str, Any], int]:
    db = get_db()
    order_id = db.execute("INSERT INTO orders (status) VALUES ('unpaid')").lastrowid
    timer = cancel_unpaid.apply_delayed((order_id,), countdown=current_app.config["ORDER_TIMEOUT"])
    db.execute("UPDATE orders SET timer = ? WHERE id = ?", (timer.id, order_id))
    return {"id": order_id, "timer": timer.id}, 201


@orders.post("/orders/<int:order_id>/pay")
def pay_order(order_id: int) -> dict[str, Any]:
    db = get_db()
    db.execute("UPDATE orders SET status = 'paid' WHERE id = ? AND status = 'unpaid'", (order_id,))
    order = db.execute("SELECT status, timer FROM orders WHERE id = ?", (order_id,)).fetchone()
    if order is None:
        abort(404)
    stopped = celery_zdelay.cancel(order["timer"], app=current_app.extensions["celery"])
    return {"id": order_id, "status": order["status"], "timer_cancelled": stopped}


@orders.get("/orders/<int:order_id>")
def show_order(order_id: int) -> dict[str, Any]:
    order = get_db().execute("SELECT status FROM orders WHERE id = ?", (order_id,)).fetchone()
    if order is None:
        abort(404)
    return {"id": order_id, "status": order["status"]}
