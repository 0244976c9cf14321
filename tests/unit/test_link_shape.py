"""The hosts bed's link shapes (bench/hosts/links.py): what `--link HOST=...` accepts and refuses,
and the qdisc each shape becomes. Applying them needs root and namespaces: tests/e2e/test_hosts.py."""

from __future__ import annotations

import pytest

from bench.hosts.links import LinkShape, _qdiscs


def test_a_shape_is_parsed_from_its_flag_text() -> None:
    assert LinkShape.parse("loss=2,rate=100") == LinkShape(loss_pct=2.0, rate_mbit=100.0)
    assert LinkShape.parse("delay=5,jitter=1.5") == LinkShape(delay_ms=5.0, jitter_ms=1.5)
    assert LinkShape.parse("") == LinkShape()
    assert str(LinkShape.parse("loss=0.5,rate=1000")) == "0.5% loss, 1000 Mbit/s"


@pytest.mark.parametrize("text, error", [("loss=2%", "loss=PCT"), ("speed=3", "loss=PCT"), ("loss=100", "loss must"),
                                         ("rate=0", "rate must"), ("delay=1,jitter=2", "jitter <= delay")])
def test_a_bad_shape_is_refused_naming_what_is_wrong(text: str, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        LinkShape.parse(text)


def test_bandwidth_is_a_token_bucket_and_delay_is_netem_carrying_the_rate() -> None:
    assert _qdiscs(LinkShape(loss_pct=2)) == []  # loss is nftables' alone
    assert _qdiscs(LinkShape.parse("rate=200"))[0][:3] == ["tbf", "rate", "200mbit"]
    assert _qdiscs(LinkShape.parse("rate=1.5,delay=5,jitter=1")) == [
        ["netem", "delay", "5ms", "1ms", "rate", "1.5mbit"]]
