"""What a join carries (unbroken.worker.join_request): a member catching up asks for a short hold,
so that the others re-form for it as soon as it has caught up; any other join waits the whole hold."""

from __future__ import annotations

from unbroken.worker import join_request


class _Client:
    def __init__(self) -> None:
        self.bodies: list[dict] = []

    def post(self, path: str, read_timeout: float = 10.0, **body):
        assert path == "/v1/join"
        self.bodies.append(body)
        return {"status": "wait"}


def test_a_join_while_catching_up_asks_for_a_short_hold_and_names_where_the_donor_streams():
    client = _Client()
    join_request.ask_to_join(client, "n1.w0.r1", "n1", 0, 3, False, {}, catch_up="10.0.0.2:4100")
    join_request.ask_to_join(client, "n1.w0.r1", "n1", 17, 3, False, {})
    catching, caught_up = client.bodies
    assert catching["catch_up"] == "10.0.0.2:4100" and 0 < catching["hold"] <= 0.25
    assert "catch_up" not in caught_up and "hold" not in caught_up and caught_up["step"] == 17
