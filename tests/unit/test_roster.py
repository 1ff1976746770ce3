"""The dealing of a departed worker's batches (gem_mpi.engine.roster), with a fake order
channel: every batch in exactly one plan, shares even, nothing dealt to a departed worker."""

from __future__ import annotations

from gem_mpi.engine.roster import Dealer, Roster
from gem_mpi.problem import elastic


def _dealer(n: int, steps: int, epochs: int = 2, max_runs: int = 64):
    plans = [elastic.source_plan(s, n, steps, epochs) for s in range(1, n + 1)]
    orders: list[tuple[int, list, int]] = []
    dealer = Dealer(Roster(n), lambda: plans, lambda w, runs, ln: orders.append((w, runs, ln)),
                    max_runs)
    return dealer, plans, orders


def _batches(plans: list[elastic.Plan]) -> list[tuple[int, int, int]]:
    return sorted((s, e, j) for p in plans for s, _, e, lo, hi in p for j in range(lo, hi))


def test_a_departed_workers_rest_goes_to_the_workers_as_they_finish():
    dealer, first, orders = _dealer(4, 10)
    assert dealer.leave(2, 7) == 13  # 20 batches, 7 done
    assert dealer.deal() == []  # nobody waits yet
    dealer.done(1, 20)
    assert dealer.deal() == [(1, 5)]  # 13 over the 3 still in the run: a share of 5
    assert orders[0][0] == 1 and orders[0][2] == 25
    assert orders[0][1][0] == (2, 4, 0, 7, 10)  # the earliest epoch first
    dealer.done(3, 20)
    dealer.done(4, 20)
    assert dealer.deal() == [(3, 3), (4, 3)]  # 8 over 3: worker 1 trains, its turn comes
    assert dealer.rest() == 2 and not dealer.over()
    dealer.done(1, 25)
    assert dealer.deal() == [(1, 1)]  # 2 over the 3 training or waiting
    while not dealer.over():  # each finishes its order and is dealt the next
        for w, length in {w: ln for w, _, ln in orders}.items():
            dealer.done(w, length)
        dealer.deal()
    assert elastic.length(dealer.plans[1]) == 7  # the departed worker's past
    assert _batches(dealer.plans) == _batches(first)  # every batch in one plan, once


def test_the_rest_of_an_order_a_worker_leaves_goes_back():
    dealer, first, _ = _dealer(2, 10, epochs=1)
    dealer.leave(2, 4)
    dealer.done(1, 10)
    assert dealer.deal() == [(1, 6)]
    dealer.leave(1, 12)  # it left 2 batches into its order
    assert dealer.rest() == 4 and dealer.roster.all_finished() and not dealer.over()
    assert _batches(dealer.plans) == _batches(first)


def test_an_order_holds_at_most_max_runs_runs():
    dealer, first, orders = _dealer(3, 5, epochs=6, max_runs=2)
    dealer.leave(3, 0)
    dealer.done(1, 30)
    dealer.done(2, 30)
    dealer.deal()
    assert all(len(runs) <= 2 for _, runs, _ in orders)
    while dealer.rest():
        for w, length in {w: ln for w, _, ln in orders}.items():
            dealer.done(w, length)
        dealer.deal()
    assert _batches(dealer.plans) == _batches(first)


def test_a_follower_counts_a_done_only_past_the_deals_it_was_told():
    roster = Roster(2)
    roster.leave(2)
    roster.dealt(1, 15)  # the lead's Deal may come before the DONE it follows
    roster.done(1, 10)
    assert not roster.all_finished()
    roster.done(1, 15)
    assert roster.all_finished() and roster.deals == 1
