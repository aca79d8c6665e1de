"""The budget ledger's SQL statements (PostgreSQL), one per operation; budgets.services runs them.

Each is prepared once per connection (budgets.services._execute). Outside a transaction it
commits alone, so the accounts it locks stay locked only while it runs; the engine runs one of
them inside each of its two transactions per step, after the run row (runs/engine/__init__.py
states that lock order). Lock order within a statement, everywhere: tenant-day sub-accounts by
shard, then the user day, then the run account.
"""

from budgets.models import BudgetAccount, LedgerEntry, Reservation

ACCOUNTS = BudgetAccount._meta.db_table
RESERVATIONS = Reservation._meta.db_table
ENTRIES = LedgerEntry._meta.db_table
# Lock one sub-account of the tenant's day, the user-day (when wanted) and run accounts; take
# `amount` from all of them only if every one has room, and only then create the reservation and
# its ledger entry. FOR NO KEY UPDATE returns the newest balances, so `room` is never stale.
# `found` < `wanted`: an account is not there (the first form: or no sub-account of the day was
# free with room, and then no day account comes back either).
#
# First form (`RESERVE_ANY`): the first sub-account, starting from the run's own, that has room
# and that no other transaction holds (SKIP LOCKED): concurrent runs of a tenant never queue
# behind each other on the day. It waits for nothing on the day; the user-day and run accounts
# are waited for as everywhere, and only once a sub-account of the day is held: when none is free
# with room it locks nothing at all, so the whole-day form that follows (RESERVE_POOLED) waits for
# the day's sub-accounts in shard order holding no budget account (services.reserve).
# Second form (`RESERVE_OWN`, one sub-account a day): the day's sub-account, waited for; it
# reports the room.
# The updates find their rows with `id = ANY(ARRAY(SELECT id FROM locked))`: the locks are
# taken (in order) before the update starts, and the rows are found by primary key whatever the
# planner thinks of the table's size (a join with the CTE was planned as a sequential scan).
_RESERVE = """
WITH day AS (
    SELECT id, scope, limit_micros - reserved_micros - spent_micros - held_micros AS room, 0 AS position
      FROM {accounts}
     WHERE tenant_id = %(tenant)s AND scope = 'tenant_day' AND day = %(day)s AND {day_rows}
), rest AS (
    SELECT id, scope, limit_micros - reserved_micros - spent_micros - held_micros AS room,
           CASE scope WHEN 'user_day' THEN 1 ELSE 2 END AS position
      FROM {accounts}
     WHERE ((tenant_id = %(tenant)s AND scope = 'user_day' AND day = %(day)s AND user_id = %(user)s)
            OR run_id = %(run)s)
       AND EXISTS (SELECT 1 FROM day)
     ORDER BY position
       FOR NO KEY UPDATE
), locked AS (
    SELECT * FROM day UNION ALL SELECT * FROM rest
), verdict AS (
    SELECT count(*) AS found, count(*) = %(wanted)s AND bool_and(room >= %(amount)s) AS fits,
           max(id) FILTER (WHERE scope = 'tenant_day') AS day_account,
           max(id) FILTER (WHERE scope = 'user_day') AS user_account,
           max(id) FILTER (WHERE scope = 'run') AS run_account,
           array_agg(scope ORDER BY position) FILTER (WHERE room < %(amount)s) AS short_scopes,
           array_agg(room ORDER BY position) FILTER (WHERE room < %(amount)s) AS short_rooms
      FROM locked
), taken AS (
    UPDATE {accounts} AS a SET reserved_micros = a.reserved_micros + %(amount)s
     WHERE a.id = ANY(ARRAY(SELECT id FROM locked)) AND (SELECT fits FROM verdict)
), created AS (
    INSERT INTO {reservations} (id, tenant_id, run_id, step_id, day_account_id, user_account_id,
                                run_account_id, purpose, day, amount_micros, status, overage, note, created_at)
    SELECT %(id)s, %(tenant)s, %(run)s, %(step)s, verdict.day_account, verdict.user_account,
           verdict.run_account, %(purpose)s, %(day)s, %(amount)s, 'open', false, %(note)s, now()
      FROM verdict WHERE verdict.fits
    RETURNING created_at
), entry AS (
    INSERT INTO {entries} (reservation_id, kind, amount_micros, note, at)
    SELECT %(id)s, 'reserve', %(amount)s, '', now() FROM created
)
SELECT verdict.fits, verdict.found, created.created_at, verdict.day_account, verdict.user_account,
       verdict.run_account, verdict.short_scopes, verdict.short_rooms,
       CASE WHEN %(relaxed)s THEN set_config('synchronous_commit', 'off', true) END
  FROM verdict LEFT JOIN created ON true
"""
RESERVE_ANY = _RESERVE.format(
    accounts=ACCOUNTS,
    reservations=RESERVATIONS,
    entries=ENTRIES,
    day_rows="""
           limit_micros - reserved_micros - spent_micros - held_micros >= %(amount)s
     ORDER BY (shard + %(shards)s - %(shard)s) %% %(shards)s
       FOR NO KEY UPDATE SKIP LOCKED LIMIT 1""",
)
RESERVE_OWN = _RESERVE.format(
    accounts=ACCOUNTS,
    reservations=RESERVATIONS,
    entries=ENTRIES,
    day_rows="""
           shard = %(shard)s
       FOR NO KEY UPDATE""",
)
# No sub-account of the day was free with room: lock all of them (in shard order, before the
# user-day and run accounts, as everywhere), and reserve if the day as a whole has room. The
# transaction holds no budget account when it starts waiting (RESERVE_ANY locked nothing), so
# its waits follow the one order and cannot close a cycle; a day not opened yet locks nothing
# here either. The free room is then spread evenly again, the run's sub-account getting `amount` on top:
# the limits still add up to the daily budget, no sub-account is left with negative room, and the
# next reservations find room in their own sub-account. The refusal here is exact: it is decided
# with the whole day locked.
RESERVE_POOLED = f"""
WITH locked AS (
    SELECT id, scope, shard, reserved_micros + spent_micros + held_micros AS used,
           limit_micros - reserved_micros - spent_micros - held_micros AS room,
           CASE scope WHEN 'tenant_day' THEN 0 WHEN 'user_day' THEN 1 ELSE 2 END AS position
      FROM {ACCOUNTS}
     WHERE (tenant_id = %(tenant)s AND scope = 'tenant_day' AND day = %(day)s)
        OR (((tenant_id = %(tenant)s AND scope = 'user_day' AND day = %(day)s AND user_id = %(user)s)
             OR run_id = %(run)s)
            AND EXISTS (SELECT 1 FROM {ACCOUNTS} d
                         WHERE d.tenant_id = %(tenant)s AND d.scope = 'tenant_day' AND d.day = %(day)s))
     ORDER BY position, shard
       FOR NO KEY UPDATE
), day AS (
    SELECT sum(room)::bigint AS free, count(*) AS shards, max(id) FILTER (WHERE shard = %(shard)s) AS target
      FROM locked WHERE scope = 'tenant_day'
), others AS (
    SELECT count(*) AS found, coalesce(bool_and(room >= %(amount)s), true) AS fit,
           max(id) FILTER (WHERE scope = 'user_day') AS user_account,
           max(id) FILTER (WHERE scope = 'run') AS run_account,
           array_agg(scope ORDER BY position) FILTER (WHERE room < %(amount)s) AS short_scopes,
           array_agg(room ORDER BY position) FILTER (WHERE room < %(amount)s) AS short_rooms
      FROM locked WHERE scope <> 'tenant_day'
), verdict AS (
    SELECT day.target IS NOT NULL AND others.found = %(wanted)s - 1 AND others.fit AND day.free >= %(amount)s AS fits
      FROM day, others
), taken AS (
    UPDATE {ACCOUNTS} AS a
       SET limit_micros = CASE WHEN locked.scope <> 'tenant_day' THEN a.limit_micros
                               ELSE locked.used + (day.free - %(amount)s) / day.shards
                                    + CASE WHEN a.id = day.target
                                           THEN %(amount)s + (day.free - %(amount)s) %% day.shards ELSE 0 END END,
           reserved_micros = a.reserved_micros
                             + CASE WHEN locked.scope <> 'tenant_day' OR a.id = day.target THEN %(amount)s ELSE 0 END
      FROM locked, day, verdict WHERE verdict.fits AND a.id = locked.id
), created AS (
    INSERT INTO {RESERVATIONS} (id, tenant_id, run_id, step_id, day_account_id, user_account_id,
                                 run_account_id, purpose, day, amount_micros, status, overage, note, created_at)
    SELECT %(id)s, %(tenant)s, %(run)s, %(step)s, day.target, others.user_account, others.run_account,
           %(purpose)s, %(day)s, %(amount)s, 'open', false, %(note)s, now()
      FROM verdict, day, others WHERE verdict.fits
    RETURNING created_at
), entry AS (
    INSERT INTO {ENTRIES} (reservation_id, kind, amount_micros, note, at)
    SELECT %(id)s, 'reserve', %(amount)s, '', now() FROM created
)
SELECT verdict.fits, day.free, created.created_at, day.target, others.user_account, others.run_account,
       others.short_scopes, others.short_rooms, others.found,
       CASE WHEN %(relaxed)s THEN set_config('synchronous_commit', 'off', true) END
  FROM verdict, day, others LEFT JOIN created ON true
"""
# Close the reservation if it is still in from_status; only then lock its accounts in order,
# move their balances and write its ledger entries. The amounts follow from the reservation's
# amount and the actual cost (see budgets.services._movement, which the portable path uses and this mirrors):
# `kind` is the closing entry; settle and reconcile also release what was not used and record
# an overage; a zero amount writes no entry. It answers with the run account's balances after the
# move (limit, reserved, spent, held), which the engine's budget event reports.
CLOSE = f"""
WITH closed AS (
    UPDATE {RESERVATIONS}
       SET status = %(to_status)s, actual_micros = %(actual)s::bigint,
           overage = coalesce(%(actual)s::bigint, 0) > amount_micros,
           closed_at = now(), closed_by_id = %(actor)s
     WHERE id = %(id)s AND status = %(from_status)s AND (step_id IS NULL OR NOT %(unlinked_only)s)
    RETURNING id, amount_micros AS amount, coalesce(%(actual)s::bigint, 0) AS actual,
              day_account_id, user_account_id, run_account_id
), locked AS (
    SELECT a.id FROM {ACCOUNTS} AS a, closed
     WHERE a.id IN (closed.day_account_id, closed.user_account_id, closed.run_account_id)
     ORDER BY CASE a.scope WHEN 'tenant_day' THEN 0 WHEN 'user_day' THEN 1 ELSE 2 END
       FOR NO KEY UPDATE OF a
), moved AS (
    UPDATE {ACCOUNTS} AS a
       SET reserved_micros = a.reserved_micros - CASE WHEN %(from_status)s = 'open' THEN closed.amount ELSE 0 END,
           held_micros = a.held_micros + CASE WHEN %(to_status)s = 'held' THEN closed.amount
                                              WHEN %(from_status)s = 'held' THEN -closed.amount ELSE 0 END,
           spent_micros = a.spent_micros + closed.actual,
           overage_micros = a.overage_micros + greatest(closed.actual - closed.amount, 0)
      FROM closed WHERE a.id = ANY(ARRAY(SELECT id FROM locked))
    RETURNING a.scope, a.limit_micros, a.reserved_micros, a.spent_micros, a.held_micros
), entries AS (
    INSERT INTO {ENTRIES} (reservation_id, kind, amount_micros, actor_id, note, at)
    SELECT closed.id, entry.kind, entry.amount, %(actor)s, %(note)s, now()
      FROM closed, LATERAL (VALUES
           (1, %(kind)s, CASE WHEN %(kind)s IN ('settle', 'reconcile') THEN closed.actual ELSE closed.amount END),
           (2, 'release', CASE WHEN %(kind)s IN ('settle', 'reconcile') THEN greatest(closed.amount - closed.actual, 0)
                               ELSE 0 END),
           (3, 'overage', greatest(closed.actual - closed.amount, 0))) AS entry(position, kind, amount)
     WHERE entry.amount <> 0
     ORDER BY entry.position
)
SELECT (SELECT count(*) FROM closed), CASE WHEN %(relaxed)s THEN set_config('synchronous_commit', 'off', true) END,
       (SELECT ARRAY[limit_micros, reserved_micros, spent_micros, held_micros] FROM moved WHERE scope = 'run')
"""
