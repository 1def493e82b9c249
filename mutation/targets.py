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
    "tests/test_entry_reads_back.py",
    "tests/test_security.py",
    "tests/test_hardening_signing.py",
    "tests/test_entry_format.py",
)
_RELEASE = ("tests/companion/test_release.py", "tests/companion/test_handoff.py")
_WEB_SECURITY = (
    "tests/web/test_allowed_hosts.py",
    "tests/web/test_tokens_and_auth.py",
)
_ACK = ("tests/store/test_acknowledged_entries.py", "tests/store/test_acknowledged_marks.py")
_OWN = ("tests/store/test_shard_ownership.py",)
_CLAIM = "tests/store/test_claim_due_entries.py"
_ADVANCE = "tests/periodic/test_pointer_advance.py"
_DEFINE = "tests/periodic/test_schedule_versions.py"
#: A configuration stored as its changes stores what the whole one would (define.lua's "diff").
_DEFINE_DIFF = "tests/periodic/test_config_diff.py"
_PARK = "tests/store/test_park_script.py"
_PARK_KEYED = "tests/store/test_keyed_parking.py"
#: A debounce's burst and its max_wait cap, exact due times (park_keyed.lua, _marks.lua).
_DEBOUNCE_MAX_WAIT = "tests/store/test_debounce_max_wait.py"
_HANDOFF = "tests/store/test_handoff_pushes_once.py"
_UNCLAIM_RECOVER = "tests/store/test_lease_return.py"
_PUSH = "tests/store/test_push_to_broker_lists.py"
_PARK_ONCE = "tests/periodic/test_occurrence_parked_once.py"
_MARKS = "tests/store/test_marks_leave_with_entry.py"
_TRANSITIONS = "tests/store/test_transitions.py"

PYTHON = (
    # Entry signing and verification: what the companion publishes is what was signed.
    Target("entry", "celery_zdelay/entry.py", _SIGNING),
    # Due times: countdown= and eta= as Celery reads them, never early.
    Target(
        "schedule",
        "celery_zdelay/schedule.py",
        (
            "tests/test_due_parsing.py",
            "tests/test_due_times.py",
            "tests/test_huge_durations.py",
            "tests/test_jitter.py",
            "tests/test_bad_input.py",
        ),
        quick=(
            "tests/test_due_parsing.py",
            "tests/test_due_times.py",
            "tests/test_huge_durations.py",
            "tests/test_jitter.py",
        ),
    ),
    # The dashboard's served hosts, origins, CSRF tokens and authentication.
    Target(
        "web.security",
        "celery_zdelay/web/security.py",
        (*_WEB_SECURITY, "tests/web/test_web_other_sites.py", "tests/web/test_web.py"),
        quick=_WEB_SECURITY,
    ),
    # Periodic occurrences: each one parked once, none missed.
    Target(
        "periodic.occurrences",
        "celery_zdelay/periodic/occurrences.py",
        (
            "tests/periodic/test_occurrences.py",
            "tests/periodic/test_periodic_timezones.py",
            "tests/periodic/test_periodic_ticks.py",
            "tests/periodic/test_periodic_reconcile.py",
            "tests/periodic/test_periodic_control.py",
            "tests/periodic/test_periodic_hardening.py",
        ),
    ),
    # The due score: due time then parking order, exact until 2248.
    Target(
        "due_score",
        "celery_zdelay/due_score.py",
        ("tests/test_due_score_order.py", "tests/store/test_scan_parked.py"),
    ),
    # The periodic part's bounded caches: one object per spec, none past its bound.
    Target(
        "periodic.recent",
        "celery_zdelay/periodic/recent.py",
        (
            "tests/periodic/test_recent.py",
            "tests/periodic/test_definitions_kept.py",
            "tests/periodic/test_schedule_objects.py",
        ),
    ),
    # Overlap policy: the headers an occurrence carries, and the key its run holds.
    Target(
        "periodic.overlap",
        "celery_zdelay/periodic/overlap.py",
        (
            "tests/periodic/test_overlap_policy.py",
            "tests/periodic/test_periodic_overlap.py",
        ),
    ),
    # The companion's publishers and publisher confirms: forgotten only when accepted.
    Target(
        "companion.publish",
        "celery_zdelay/companion/publish/generic.py",
        (
            "tests/companion/publish/test_generic_publisher.py",
            "tests/companion/publish/test_generic_publisher_connection.py",
            "tests/companion/publish/test_hardening_publish.py",
            *_RELEASE,
        ),
    ),
    Target(
        "companion.publish.redis_broker",
        "celery_zdelay/companion/publish/redis_broker.py",
        (
            "tests/companion/publish/test_redis_broker_publisher.py",
            "tests/companion/publish/test_hardening_publish.py",
            *_RELEASE,
        ),
    ),
    Target(
        "companion.publish.confirming",
        "celery_zdelay/companion/publish/confirming.py",
        (
            "tests/companion/publish/test_confirm_publisher.py",
            "tests/companion/publish/test_hardening_publish.py",
            *_RELEASE,
        ),
    ),
    # The worker's hooks: the second-delivery guard; an occurrence starting while
    # the previous run goes on is skipped or waits; a run's key freed however it
    # ends; request.eta given back.
    Target(
        "worker",
        "celery_zdelay/worker.py",
        (
            "tests/test_dedupe_guard.py",
            "tests/periodic/test_overlap_policy.py",
            "tests/test_dedupe.py",
            "tests/periodic/test_periodic_overlap.py",
            "tests/test_run_ends.py",
            "tests/test_request_eta.py",
        ),
    ),
    # The one read model: every reader (lookup, listings, dead letters, the
    # dashboard, the CLI) gives an id the same state and the same fields.
    Target(
        "store.read_model",
        "celery_zdelay/store/read_model.py",
        (
            "tests/store/test_read_model.py",
            "tests/test_state_spelling.py",
            "tests/store/test_admin.py",
            "tests/cli/test_cli.py",
        ),
        quick=("tests/store/test_read_model.py", "tests/test_state_spelling.py"),
    ),
    # zdelay adopt --redis-plus: celery-redis-plus's waiting messages read as
    # kombu reads them, and taken out only while no consumer holds them.
    Target(
        "redis_plus",
        "celery_zdelay/redis_plus.py",
        ("tests/test_redis_plus_waiting_messages.py", "tests/test_adopt_redis_plus.py"),
    ),
    # Capture: the message Celery would have sent is the one parked.
    Target(
        "capture",
        "celery_zdelay/capture.py",
        (
            "tests/test_capture.py",
            "tests/test_entry_many.py",
            "tests/test_transparent.py",
            "tests/test_fidelity.py",
        ),
    ),
)

_STORE = "celery_zdelay/store/lua/"
_PERIODIC = "celery_zdelay/periodic/lua/"
_PERIODIC_TESTS = (
    "tests/periodic/test_periodic_ticks.py",
    "tests/periodic/test_periodic_reconcile.py",
    "tests/periodic/test_periodic_control.py",
    "tests/periodic/test_periodic_hardening.py",
)
_ADMIN = ("tests/store/test_admin.py",)
_REQUEUE_PURGE = "tests/store/test_requeue_and_purge.py"
_WITHDRAW = "tests/periodic/test_withdrawal.py"
_PAUSE = "tests/periodic/test_pause_resume_schedule.py"
#: What define.lua and pause.lua name as taken back ends REVOKED, once.
_WITHDRAWN = "tests/periodic/test_withdrawn_revoked.py"
_STEERING = (
    "tests/store/test_cancel_reschedule_exact.py",
    "tests/test_cancel_reschedule.py",
)
#: Held tasks (pauses, rate limits) listed, rescheduled and cancelled.
_HELD = "tests/test_held_steering.py"
_OVERLAP_KILLS = "tests/periodic/test_overlap_policy.py"
_FINISH_START = "tests/store/test_run_keys.py"
_FORGET_ALLOWED = "tests/store/test_lanes_and_acl_precheck.py"
#: A held task meets a key, a requeue, a purge: where an id is (_where.lua).
_HELD_MEETS = "tests/store/test_held_meets_keys_and_dead_letters.py"
#: A held task parked again under its id: one entry, released once.
_HELD_AGAIN = "tests/store/test_held_parked_again.py"

LUA = (
    # Loaded in front of every script: the scripts' kill tests exercise it.
    Target(
        "_guard.lua",
        _STORE + "_guard.lua",
        (
            "tests/store/test_script_guards.py",
            "tests/store/test_store_refusals.py",
            _PARK,
            _PARK_KEYED,
            *_ACK,
            _CLAIM,
            _HANDOFF,
            *_STEERING[:1],
            "tests/store/test_reschedule_held.py",
            "tests/store/test_holding.py",
            "tests/store/test_token_buckets.py",
            *_OWN,
            _PAUSE,
            _WITHDRAW,
            _DEFINE,
            _ADVANCE,
            "tests/periodic/test_last_run_record.py",
            _PARK_ONCE,
            _PUSH,
            _UNCLAIM_RECOVER,
            "tests/store/test_dead_lettering.py",
            "tests/store/test_requeue_and_purge.py",
            "tests/store/test_handoff_entry_reader.py",
            _MARKS,
            _FINISH_START,
            _FORGET_ALLOWED,
            "tests/store/test_hardening_store.py",
            # The held sets a park is given (zdelay_park_layout's loop over them).
            _HELD_AGAIN,
        ),
    ),
    # Loaded in front of every script that removes entries (and of park,
    # park_keyed, finish_key, start_run): the key and tag index exact after
    # each removal, and after an id is parked again.
    Target(
        "_marks.lua",
        _STORE + "_marks.lua",
        (
            _MARKS,
            _PARK_KEYED,
            _DEBOUNCE_MAX_WAIT,
            _PARK,
            *_ACK,
            *_STEERING[:1],
            _REQUEUE_PURGE,
            "tests/store/test_dead_lettering.py",
            _HANDOFF,
            _PUSH,
            _FINISH_START,
            "tests/periodic/test_overlap_policy.py",
        ),
    ),
    # Every move of an entry's state, written once: the only writer of the
    # state keys (due, msg, lease, held, dead, the key and tag index, the
    # template counts). Each script's kill tests check the keys after its move.
    Target(
        "_transitions.lua",
        _STORE + "_transitions.lua",
        (
            _TRANSITIONS,
            _PARK,
            _CLAIM,
            _UNCLAIM_RECOVER,
            "tests/store/test_holding.py",
            *_ACK,
            _PUSH,
            _HANDOFF,
            "tests/store/test_dead_lettering.py",
            *_STEERING[:1],
            "tests/store/test_reschedule_held.py",
            _REQUEUE_PURGE,
            _MARKS,
            _PARK_KEYED,
            _FINISH_START,
            _FORGET_ALLOWED,
            _WITHDRAW,
            _HELD_MEETS,
            _HELD_AGAIN,
        ),
    ),
    # Loaded in front of every script that includes _transitions.lua: each
    # transition's history line (what, when, why, by whom), capped, and the
    # key checked before any write.
    Target(
        "_history.lua",
        _STORE + "_history.lua",
        (
            "tests/store/test_history_lines.py",
            "tests/store/test_history.py",
            "tests/cli/test_cli_history.py",
            "tests/companion/test_history_story.py",
        ),
    ),
    # Where an id is now (due, held, in flight), for every script that asks.
    Target(
        "_where.lua",
        _STORE + "_where.lua",
        (_HELD_MEETS, _REQUEUE_PURGE, _PARK_KEYED, _FINISH_START, _HELD_AGAIN),
    ),
    # A key owner a producer found forged (with signing) is forgotten, only as checked.
    Target(
        "drop_key.lua",
        _STORE + "drop_key.lua",
        (
            _MARKS,
            "tests/test_keys.py::test_a_forged_key_cannot_make_replace_cancel_a_signed_entry"
            "_parked_under_another_key",
            "tests/test_keys.py::test_a_forged_running_owner_cannot_make_keep_return_a_signed_entry",
        ),
    ),
    # zdelay adopt: a message taken from a broker queue is parked the first time only.
    Target(
        "adopt_once.lua",
        _STORE + "adopt_once.lua",
        ("tests/store/test_adopt_once.py",),
    ),
    # The entry reader, loaded in front of handoff.lua: its kill tests read every form.
    Target(
        "_expand.lua",
        _STORE + "_expand.lua",
        (
            "tests/store/test_handoff_entry_reader.py",
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
            _DEBOUNCE_MAX_WAIT,
            "tests/test_keys.py",
            "tests/store/test_acknowledged_marks.py",
            _HELD_MEETS,
            _HELD_AGAIN,
        ),
    ),
    # zdelay adopt --redis-plus takes a message out of celery-redis-plus
    # only while no consumer holds it (beside celery_zdelay/redis_plus.py).
    Target(
        "redis_plus_take.lua",
        "celery_zdelay/redis_plus_take.lua",
        ("tests/test_redis_plus_waiting_messages.py", "tests/test_adopt_redis_plus.py"),
        quick=("tests/test_redis_plus_waiting_messages.py",),
    ),
    Target(
        "claim.lua",
        _STORE + "claim.lua",
        (_CLAIM, "tests/companion/test_crash_recovery.py", *_RELEASE),
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
        (*_ACK, "tests/companion/test_crash_recovery.py", *_RELEASE),
        quick=_ACK,
    ),
    # Release control: held entries and the rate limits' token buckets.
    Target(
        "hold.lua",
        _STORE + "hold.lua",
        ("tests/store/test_holding.py", "tests/test_pause.py"),
    ),
    Target(
        "take_tokens.lua",
        _STORE + "take_tokens.lua",
        ("tests/store/test_token_buckets.py", "tests/test_rate_limits.py"),
    ),
    # A lease ends: given back (unclaim) or expired (recover), due again at its own score.
    Target(
        "unclaim.lua",
        _STORE + "unclaim.lua",
        (
            _UNCLAIM_RECOVER,
            "tests/companion/test_crash_recovery.py",
            "tests/companion/publish/test_hardening_publish.py",
        ),
    ),
    Target(
        "recover.lua",
        _STORE + "recover.lua",
        (_UNCLAIM_RECOVER, "tests/companion/test_crash_recovery.py"),
    ),
    # Dead letters: what moves where, the reasons, the marks kept for a requeue.
    Target(
        "deadletter.lua",
        _STORE + "deadletter.lua",
        ("tests/store/test_dead_lettering.py", "tests/test_security.py", *_ADMIN),
    ),
    Target("cancel.lua", _STORE + "cancel.lua", (*_STEERING, _HELD)),
    Target(
        "reschedule.lua",
        _STORE + "reschedule.lua",
        ("tests/store/test_reschedule_held.py", *_STEERING, _HELD),
    ),
    # Dead letters requeued (payload, keys, tags) or purged (template counts).
    Target("requeue.lua", _STORE + "requeue.lua", (_REQUEUE_PURGE, _HELD_MEETS, *_ADMIN)),
    Target("purge.lua", _STORE + "purge.lua", (_REQUEUE_PURGE, _HELD_MEETS, *_ADMIN)),
    Target(
        "own.lua",
        _STORE + "own.lua",
        (*_OWN, "tests/companion/test_shard_leases.py"),
        quick=_OWN,
    ),
    Target(
        "_pointer.lua",
        _PERIODIC + "_pointer.lua",
        ("tests/periodic/test_next_visit_score.py", _PARK_ONCE, *_PERIODIC_TESTS),
    ),
    Target(
        "_withdraw.lua",
        _PERIODIC + "_withdraw.lua",
        (_WITHDRAW, *_PERIODIC_TESTS),
    ),
    Target(
        "define.lua",
        _PERIODIC + "define.lua",
        (_DEFINE, _DEFINE_DIFF, _WITHDRAW, _WITHDRAWN, *_PERIODIC_TESTS),
    ),
    Target(
        "advance.lua",
        _PERIODIC + "advance.lua",
        # test_park_lead: the wake cleared and the visit scored as the pointer moves.
        (_ADVANCE, "tests/periodic/test_park_lead.py", *_PERIODIC_TESTS),
    ),
    Target("pause.lua", _PERIODIC + "pause.lua", (_PAUSE, _WITHDRAW, _WITHDRAWN, *_PERIODIC_TESTS)),
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
        (_FINISH_START, _OVERLAP_KILLS, "tests/periodic/test_periodic_overlap.py"),
    ),
    # A held set is forgotten only once empty, in one step with the count.
    Target(
        "forget_lane.lua",
        _STORE + "forget_lane.lua",
        (_FORGET_ALLOWED, _HELD, "tests/test_pause.py", "tests/test_rate_limits.py"),
    ),
    # Concurrency slots: never more than the limit live, an ended slot free again.
    Target(
        "take_slots.lua",
        _STORE + "take_slots.lua",
        ("tests/store/test_concurrency_slots.py", "tests/test_concurrency.py"),
    ),
    # A stale entry dropped: lease -> gone under its own claim, with its marks and counts.
    Target(
        "drop_stale.lua",
        _STORE + "drop_stale.lua",
        (
            "tests/store/test_stale_drop.py",
            "tests/test_stale.py::test_drop_takes_an_entry_from_the_lease_only_under_its_own_claim",
            "tests/test_stale.py::test_a_dropped_stale_task_ends_revoked_with_the_signal_and_the_flower_event",
        ),
    ),
    # The ACL pre-check: a script refused before its first write, naming the command.
    Target("allowed.lua", _STORE + "allowed.lua", (_FORGET_ALLOWED, "tests/store/test_acl.py")),
    # The last run of each schedule, recorded once and only over an older one.
    Target(
        "record_runs.lua",
        _PERIODIC + "record_runs.lua",
        ("tests/periodic/test_last_run_record.py", "tests/periodic/test_periodic_settle.py"),
    ),
    # The planner's index: a schedule a pass left untouched is looked at again
    # when its pointer or its next unrun occurrence is due, never sooner.
    Target(
        "revisit.lua",
        _PERIODIC + "revisit.lua",
        ("tests/periodic/test_revisit.py", "tests/periodic/test_planner_cost.py"),
    ),
    # A far occurrence written down and its schedule's next look put off,
    # only for the pointer as the planner read it.
    Target(
        "defer.lua",
        _PERIODIC + "defer.lua",
        ("tests/periodic/test_park_lead.py", "tests/periodic/test_next_visit_score.py"),
    ),
)

#: The kill tests: files written against the mutants the rest of the suite let
#: survive (each says so, citing docs/mutation.rst), named for the promise they
#: pin and kept beside the other tests of their module. They need no worker or
#: companion: ``--kills`` runs each target against these only.
KILL_TESTS = frozenset(
    {
        "tests/test_due_parsing.py",
        "tests/periodic/test_periodic_timezones.py",
        "tests/companion/publish/test_confirm_publisher.py",
        "tests/companion/publish/test_generic_publisher.py",
        "tests/companion/publish/test_generic_publisher_connection.py",
        "tests/companion/publish/test_redis_broker_publisher.py",
        "tests/periodic/test_last_run_record.py",
        "tests/periodic/test_occurrence_parked_once.py",
        "tests/periodic/test_occurrences.py",
        "tests/periodic/test_overlap_policy.py",
        "tests/periodic/test_pause_resume_schedule.py",
        "tests/periodic/test_pointer_advance.py",
        "tests/periodic/test_revisit.py",
        "tests/periodic/test_next_visit_score.py",
        "tests/store/test_concurrency_slots.py",
        "tests/store/test_stale_drop.py",
        "tests/store/test_adopt_once.py",
        "tests/periodic/test_schedule_versions.py",
        "tests/periodic/test_config_diff.py",
        "tests/periodic/test_withdrawal.py",
        "tests/store/test_acknowledged_entries.py",
        "tests/store/test_acknowledged_marks.py",
        "tests/store/test_cancel_reschedule_exact.py",
        "tests/store/test_claim_due_entries.py",
        "tests/store/test_dead_lettering.py",
        "tests/store/test_handoff_entry_reader.py",
        "tests/store/test_handoff_pushes_once.py",
        "tests/store/test_history_lines.py",
        "tests/store/test_holding.py",
        "tests/store/test_keyed_parking.py",
        "tests/store/test_lanes_and_acl_precheck.py",
        "tests/store/test_lease_return.py",
        "tests/store/test_marks_leave_with_entry.py",
        "tests/store/test_park_script.py",
        "tests/store/test_push_to_broker_lists.py",
        "tests/store/test_requeue_and_purge.py",
        "tests/store/test_reschedule_held.py",
        "tests/store/test_run_keys.py",
        "tests/store/test_script_guards.py",
        "tests/store/test_shard_ownership.py",
        "tests/store/test_token_buckets.py",
        "tests/store/test_transitions.py",
        "tests/test_capture.py",
        "tests/test_dedupe_guard.py",
        "tests/test_redis_plus_waiting_messages.py",
        "tests/test_due_score_order.py",
        "tests/test_due_times.py",
        "tests/test_entry_reads_back.py",
        "tests/web/test_allowed_hosts.py",
        "tests/web/test_tokens_and_auth.py",
    }
)

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
    """*target*'s kill tests: its files (or node ids) in :data:`KILL_TESTS`."""
    return tuple(t for t in target.tests if t.split("::")[0] in KILL_TESTS)
