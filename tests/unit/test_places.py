"""`LostPlaces`: which step a given-up group's place is in, worked by hand (4 groups a step)."""

from __future__ import annotations

from streamrl.learner.places import LostPlaces


def test_a_lost_group_leaves_its_place_in_its_own_step_and_the_places_end_with_their_steps():
    places = LostPlaces(4)
    order = ["a", "b", "c", "d", "e", "f", "g", "h"]  # admission order: step 0 is a-d, step 1 e-h
    assert places.step_of("b", order) == 0 and places.step_of("e", order) == 1
    assert places.lose("b", order)
    order.remove("b")
    # step 0 is now a, c, d (3 places), so e is still step 1's first group, not step 0's fourth
    assert places.step_of("e", order) == 1 and places.short == 1 and places.held == 1
    assert places.lose("f", order)
    order.remove("f")
    assert places.step_of("h", order) == 1 and places.held == 2
    assert places.step_done() == 1  # step 0 ended: its place with it; step 1's place is now the step's own
    assert places.short == 1 and places.step_of("h", ["e", "g", "h"]) == 0


def test_a_step_keeps_one_group_and_an_unknown_group_leaves_no_place():
    places = LostPlaces(2)
    order = ["a", "b", "c"]
    assert places.lose("a", order)
    order.remove("a")
    assert not places.lose("b", order)  # step 0 would have none: its place goes back, the next group fills it
    assert not places.lose("x", order) and places.held == 1
    assert not LostPlaces(1).lose("a", ["a"])  # one group a step: no place is ever left empty
