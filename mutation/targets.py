"""What is mutated, and the tests each mutant runs against.

Each target is one file that guards a promise, with the tests that cover
that promise: a mutant runs only those (``pytest -x``: the first failure
kills it), so the whole run fits a stated time on a 2-core machine (see
docs/mutation.rst for the time it took). A test added for a promise goes
into its target's list here too, or the run does not see it.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LUA", "PYTHON", "QUICK", "Target", "by_name"]


@dataclass(frozen=True)
class Target:
    """A file to mutate, and the test files (or node ids) that must catch each mutant.

    *quick* is what ``make mutants-quick`` (CI) runs instead of *tests*: the
    target's kill tests, which need no worker, so that each mutant costs one
    pytest start. Empty: the target is not in the quick subset (give it
    *quick* once those tests alone kill 90 % of its mutants).
    """

    name: str
    path: str
    tests: tuple[str, ...]
    quick: tuple[str, ...] = ()

    @property
    def is_lua(self) -> bool:
        return self.path.endswith(".lua")


# A target's own kill tests come first: they need no worker or companion,
# so most mutants are killed within seconds.
_SIGNING = (
    "tests/test_mutation_kills_entry.py",
    "tests/test_security.py",
    "tests/test_hardening_signing.py",
    "tests/test_entry_format.py",
)
_RELEASE = ("tests/test_release.py", "tests/test_handoff.py")
_WEB_SECURITY = (
    "tests/test_mutation_kills_web_hosts.py",
    "tests/test_mutation_kills_web_security.py",
)
_ACK = ("tests/test_mutation_kills_ack_lua.py", "tests/test_mutation_kills_ack_lua_marks.py")
_OWN = ("tests/test_mutation_kills_own_lua.py",)
_CLAIM = "tests/test_mutation_kills_claim_lua.py"
_ADVANCE = "tests/test_mutation_kills_advance_lua.py"
_DEFINE = "tests/test_mutation_kills_define_lua.py"
_PARK = "tests/test_mutation_kills_park_lua.py"
_PARK_KEYED = "tests/test_mutation_kills_park_keyed_lua.py"
_HANDOFF = "tests/test_mutation_kills_handoff_lua.py"
_UNCLAIM_RECOVER = "tests/test_mutation_kills_unclaim_recover_lua.py"
_PUSH = "tests/test_mutation_kills_push_lua.py"
_PARK_ONCE = "tests/test_mutation_kills_park_once_lua.py"
_MARKS = "tests/test_mutation_kills_marks_lua.py"

PYTHON = (
    # Entry signing and verification: what the companion publishes is what was signed.
    Target("entry", "celery_zdelay/entry.py", _SIGNING),
    # Due times: countdown= and eta= as Celery reads them, never early.
    Target(
        "schedule",
        "celery_zdelay/schedule.py",
        ("tests/test_mutation_kills_schedule.py", "tests/test_bad_input.py"),
        quick=("tests/test_mutation_kills_schedule.py",),
    ),
    # The dashboard's served hosts, origins, CSRF tokens and authentication.
    Target(
        "web.security",
        "celery_zdelay/web/security.py",
        (*_WEB_SECURITY, "tests/test_web_other_sites.py", "tests/test_web.py"),
        quick=_WEB_SECURITY,
    ),
    # Periodic occurrences: each one parked once, none missed.
    Target(
        "periodic.occurrences",
        "celery_zdelay/periodic/occurrences.py",
        (
            "tests/test_mutation_kills_periodic_occurrences.py",
            "tests/test_periodic_ticks.py",
            "tests/test_periodic_reconcile.py",
            "tests/test_periodic_control.py",
            "tests/test_periodic_hardening.py",
        ),
    ),
    # The due score: due time then parking order, exact until 2248.
    Target(
        "due_score",
        "celery_zdelay/due_score.py",
        ("tests/test_mutation_kills_due_score.py", "tests/test_scan_parked.py"),
    ),
    # Overlap policy: an occurrence starting while the previous run goes on is skipped or waits.
    Target(
        "periodic.overlap",
        "celery_zdelay/periodic/overlap.py",
        ("tests/test_mutation_kills_periodic_overlap.py", "tests/test_periodic_overlap.py"),
    ),
    # The companion's publishers and publisher confirms: forgotten only when accepted.
    Target(
        "companion.publish",
        "celery_zdelay/companion/publish/generic.py",
        (
            "tests/test_mutation_kills_generic_publish.py",
            "tests/test_mutation_kills_generic_publish_connection.py",
            "tests/test_hardening_publish.py",
            *_RELEASE,
        ),
    ),
    Target(
        "companion.publish.redis_broker",
        "celery_zdelay/companion/publish/redis_broker.py",
        (
            "tests/test_mutation_kills_redis_broker_publish.py",
            "tests/test_hardening_publish.py",
            *_RELEASE,
        ),
    ),
    Target(
        "companion.publish.confirming",
        "celery_zdelay/companion/publish/confirming.py",
        ("tests/test_mutation_kills_confirming.py", "tests/test_hardening_publish.py", *_RELEASE),
    ),
    # The second-delivery guard.
    Target(
        "dedupe",
        "celery_zdelay/dedupe.py",
        ("tests/test_mutation_kills_dedupe.py", "tests/test_dedupe.py"),
    ),
    # Capture: the message Celery would have sent is the one parked.
    Target(
        "capture",
        "celery_zdelay/capture.py",
        (
            "tests/test_mutation_kills_capture.py",
            "tests/test_entry_many.py",
            "tests/test_transparent.py",
            "tests/test_fidelity.py",
        ),
    ),
)

_STORE = "celery_zdelay/store/lua/"
_PERIODIC = "celery_zdelay/periodic/lua/"
_PERIODIC_TESTS = (
    "tests/test_periodic_ticks.py",
    "tests/test_periodic_reconcile.py",
    "tests/test_periodic_control.py",
    "tests/test_periodic_hardening.py",
)
_ADMIN = ("tests/test_admin.py",)
_REQUEUE_PURGE = "tests/test_mutation_kills_requeue_purge_lua.py"
_WITHDRAW = "tests/test_mutation_kills_withdraw_lua.py"
_PAUSE = "tests/test_mutation_kills_pause_lua.py"
_STEERING = (
    "tests/test_mutation_kills_cancel_reschedule_lua.py",
    "tests/test_cancel_reschedule.py",
)
#: Held tasks (pauses, rate limits) listed, rescheduled and cancelled.
_HELD = "tests/test_held_steering.py"
_OVERLAP_KILLS = "tests/test_mutation_kills_periodic_overlap.py"
_FINISH_START = "tests/test_mutation_kills_finish_start_lua.py"
_FORGET_ALLOWED = "tests/test_mutation_kills_forget_lane_allowed_lua.py"
#: A held task meets a key, a requeue, a purge: where an id is (_where.lua).
_HELD_MEETS = "tests/test_held_meets_keys_and_dead_letters.py"
#: A held task parked again under its id: one entry, released once.
_HELD_AGAIN = "tests/test_held_parked_again.py"

LUA = (
    # Loaded in front of every script: the scripts' kill tests exercise it.
    Target(
        "_guard.lua",
        _STORE + "_guard.lua",
        (
            "tests/test_mutation_kills_guard_lua.py",
            "tests/test_store_refusals.py",
            _PARK,
            _PARK_KEYED,
            *_ACK,
            _CLAIM,
            _HANDOFF,
            *_STEERING[:1],
            "tests/test_mutation_kills_reschedule_held_lua.py",
            "tests/test_mutation_kills_hold_lua.py",
            "tests/test_mutation_kills_take_tokens_lua.py",
            *_OWN,
            _PAUSE,
            _WITHDRAW,
            _DEFINE,
            _ADVANCE,
            "tests/test_mutation_kills_record_runs_lua.py",
            _PARK_ONCE,
            _PUSH,
            _UNCLAIM_RECOVER,
            "tests/test_mutation_kills_deadletter_lua.py",
            "tests/test_mutation_kills_requeue_purge_lua.py",
            "tests/test_mutation_kills_expand_lua.py",
            _MARKS,
            _FINISH_START,
            _FORGET_ALLOWED,
            "tests/test_hardening_store.py",
        ),
    ),
    # Loaded in front of every script that removes entries (and of park_keyed,
    # finish_key, start_run): the key and tag index exact after each removal.
    Target(
        "_marks.lua",
        _STORE + "_marks.lua",
        (
            _MARKS,
            _PARK_KEYED,
            *_ACK,
            *_STEERING[:1],
            _REQUEUE_PURGE,
            "tests/test_mutation_kills_deadletter_lua.py",
            _HANDOFF,
            _PUSH,
            _FINISH_START,
            "tests/test_mutation_kills_periodic_overlap.py",
        ),
    ),
    # Where an id is now (due, held, in flight), for every script that asks.
    Target(
        "_where.lua",
        _STORE + "_where.lua",
        (_HELD_MEETS, _REQUEUE_PURGE, _PARK_KEYED, _FINISH_START, _HELD_AGAIN),
    ),
    # A key holder a producer found forged (with signing) is forgotten, only as checked.
    Target(
        "drop_key.lua",
        _STORE + "drop_key.lua",
        (
            _MARKS,
            "tests/test_keys.py::test_a_forged_key_cannot_make_replace_cancel_a_signed_entry"
            "_parked_under_another_key",
            "tests/test_keys.py::test_a_forged_running_hold_cannot_make_keep_return_a_signed_entry",
        ),
    ),
    # The entry reader, loaded in front of handoff.lua: its kill tests read every form.
    Target(
        "_expand.lua",
        _STORE + "_expand.lua",
        (
            "tests/test_mutation_kills_expand_lua.py",
            _HANDOFF,
            "tests/test_entry_format.py",
            *_RELEASE,
        ),
    ),
    Target(
        "park.lua",
        _STORE + "park.lua",
        (_PARK, "tests/test_parked_at.py", "tests/test_bulk_parking.py", _HELD_AGAIN),
    ),
    # Keys and tags: one entry per key as its mode says, the index exact.
    Target(
        "park_keyed.lua",
        _STORE + "park_keyed.lua",
        (
            _PARK_KEYED,
            "tests/test_keys.py",
            "tests/test_mutation_kills_ack_lua_marks.py",
            _HELD_MEETS,
            _HELD_AGAIN,
        ),
    ),
    Target(
        "claim.lua",
        _STORE + "claim.lua",
        (_CLAIM, "tests/test_crash_recovery.py", *_RELEASE),
    ),
    Target(
        "handoff.lua",
        _STORE + "handoff.lua",
        (_HANDOFF, *_RELEASE, "tests/test_hardening_signing.py"),
    ),
    # Leased (signed) entries pushed into the Redis broker's lists as verified, once.
    Target(
        "push.lua",
        _STORE + "push.lua",
        (_PUSH, *_RELEASE, "tests/test_hardening_signing.py"),
    ),
    Target(
        "ack.lua",
        _STORE + "ack.lua",
        (*_ACK, "tests/test_crash_recovery.py", *_RELEASE),
        quick=_ACK,
    ),
    # Release control: held entries and the rate limits' token buckets.
    Target(
        "hold.lua",
        _STORE + "hold.lua",
        ("tests/test_mutation_kills_hold_lua.py", "tests/test_pause.py"),
    ),
    Target(
        "take_tokens.lua",
        _STORE + "take_tokens.lua",
        ("tests/test_mutation_kills_take_tokens_lua.py", "tests/test_rate_limits.py"),
    ),
    # A lease ends: given back (unclaim) or expired (recover), due again at its own score.
    Target(
        "unclaim.lua",
        _STORE + "unclaim.lua",
        (_UNCLAIM_RECOVER, "tests/test_crash_recovery.py", "tests/test_hardening_publish.py"),
    ),
    Target(
        "recover.lua",
        _STORE + "recover.lua",
        (_UNCLAIM_RECOVER, "tests/test_crash_recovery.py"),
    ),
    # Dead letters: what moves where, the reasons, the marks kept for a requeue.
    Target(
        "deadletter.lua",
        _STORE + "deadletter.lua",
        ("tests/test_mutation_kills_deadletter_lua.py", "tests/test_security.py", *_ADMIN),
    ),
    Target("cancel.lua", _STORE + "cancel.lua", (*_STEERING, _HELD)),
    Target(
        "reschedule.lua",
        _STORE + "reschedule.lua",
        ("tests/test_mutation_kills_reschedule_held_lua.py", *_STEERING, _HELD),
    ),
    # Dead letters requeued (payload, keys, tags) or purged (template counts).
    Target("requeue.lua", _STORE + "requeue.lua", (_REQUEUE_PURGE, _HELD_MEETS, *_ADMIN)),
    Target("purge.lua", _STORE + "purge.lua", (_REQUEUE_PURGE, _HELD_MEETS, *_ADMIN)),
    Target(
        "own.lua",
        _STORE + "own.lua",
        (*_OWN, "tests/test_shard_leases.py"),
        quick=_OWN,
    ),
    Target("_pointer.lua", _PERIODIC + "_pointer.lua", (_PARK_ONCE, *_PERIODIC_TESTS)),
    Target(
        "_withdraw.lua",
        _PERIODIC + "_withdraw.lua",
        (_WITHDRAW, *_PERIODIC_TESTS),
    ),
    Target(
        "define.lua",
        _PERIODIC + "define.lua",
        (_DEFINE, _WITHDRAW, *_PERIODIC_TESTS),
    ),
    Target(
        "advance.lua",
        _PERIODIC + "advance.lua",
        (_ADVANCE, *_PERIODIC_TESTS),
    ),
    Target("pause.lua", _PERIODIC + "pause.lua", (_PAUSE, _WITHDRAW, *_PERIODIC_TESTS)),
    Target(
        "park_once.lua",
        _PERIODIC + "park_once.lua",
        (_PARK_ONCE, *_PERIODIC_TESTS, _HELD_AGAIN),
    ),
    # until_finished keys: a worker frees only its own hold, never a parked-again id's.
    Target(
        "finish_key.lua",
        _STORE + "finish_key.lua",
        (_FINISH_START, _OVERLAP_KILLS, "tests/test_keys.py", _HELD_MEETS),
    ),
    # Overlap policies: a periodic run takes its schedule's key, or waits, or is skipped.
    Target(
        "start_run.lua",
        _STORE + "start_run.lua",
        (_FINISH_START, _OVERLAP_KILLS, "tests/test_periodic_overlap.py"),
    ),
    # A held set is forgotten only once empty, in one step with the count.
    Target(
        "forget_lane.lua",
        _STORE + "forget_lane.lua",
        (_FORGET_ALLOWED, _HELD, "tests/test_pause.py", "tests/test_rate_limits.py"),
    ),
    # The ACL pre-check: a script refused before its first write, naming the command.
    Target("allowed.lua", _STORE + "allowed.lua", (_FORGET_ALLOWED, "tests/test_acl.py")),
    # The last run of each schedule, recorded once and only over an older one.
    Target(
        "record_runs.lua",
        _PERIODIC + "record_runs.lua",
        ("tests/test_mutation_kills_record_runs_lua.py", "tests/test_periodic_settle.py"),
    ),
)

#: The name every kill-test file starts with: tests that need no worker or companion
#: (``--kills`` runs each target against these only).
KILLS = "test_mutation_kills_"

#: ``make mutants-quick`` (CI): the targets with *quick* tests, each run against those only.
QUICK = tuple(t.name for t in (*PYTHON, *LUA) if t.quick)


def by_name(name: str) -> Target:
    """The target called *name* (a module's dotted name or a script's file name)."""
    for target in (*PYTHON, *LUA):
        if target.name == name:
            return target
    names = ", ".join(t.name for t in (*PYTHON, *LUA))
    raise SystemExit(f"No mutation target {name!r}; the targets are: {names}.")


def kill_tests(target: Target) -> tuple[str, ...]:
    """*target*'s kill tests: its ``tests/test_mutation_kills_*.py`` files."""
    return tuple(t for t in target.tests if t.split("::")[0].rsplit("/", 1)[-1].startswith(KILLS))
