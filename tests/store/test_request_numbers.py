"""Request numbers: one use per request, however its calls interleave."""

from kvtier.store.request_numbers import Requests


def test_a_request_keeps_its_number_from_arrival_to_after_it_finished():
    r = Requests()
    assert r.queued("a") == 0 and r.queued("a") == 0  # announced twice: one request
    assert r.started("b") == (1, True)  # never announced: numbered as it starts
    assert r.started("a") == (0, True) and r.started("a") == (0, False)
    assert r.finished("a") == 0
    # an engine may save the reply after saying the request finished (vLLM does): still its use
    assert r.use_of("a", finished=True) == 0
    # a lookup under that name is a new request's whose announcement is late (an engine that
    # restarted numbers its requests "0", "1", ... again): not the old one's
    assert r.use_of("a") is None
    assert r.finished("a") is None  # finished twice: no second end
    assert r.finished("never") is None and r.use_of("never") is None


def test_a_name_used_again_after_it_finished_is_a_new_request():
    r = Requests()
    r.started("a")
    r.finished("a")
    assert r.queued("a") == 1 and r.use_of("a") == 1 and r.use_of("a", finished=True) == 1
    r.started("a")
    r.finished("a")
    assert r.started("a") == (2, True) and r.use_of("a") == 2
