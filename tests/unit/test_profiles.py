"""Worker profiles: the cost model, the file format and its errors, the fit, and the mocker
running a profile as its timing."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path

import pytest

from services.engines.mocker.timing import TimingModel
from services.profiles.cost_model import ADAPTER_LOAD_S_PER_GB, CostModel, ProfileError
from services.profiles.fit import fit_adapter_load, fit_cost_model, fit_error
from services.profiles.profile_file import DEFAULT_PRESET, FORMAT, WorkerProfile, load_profile, preset_names, save_profile

TRUTH = CostModel(prefill_base_s=0.004, prefill_per_token_s=30e-6, prefill_quadratic_s_per_1k=2e-6,
                  decode_base_s=0.010, decode_per_seq_s=60e-6, decode_per_context_token_s=5e-9)


def test_every_preset_loads_and_says_what_it_is() -> None:
    assert {"h100-8b", "large-gpu-8b", "fixed-step-20ms"} <= set(preset_names())
    for name in preset_names():
        p = load_profile(name)
        assert p.source.startswith("preset") and p.prefill_points and p.decode_points
        assert p.fit_error["prefill"] < 1e-9 and p.fit_error["decode"] < 1e-9  # points made from the model


def test_a_profile_round_trips_through_its_file(tmp_path: Path) -> None:
    p = WorkerProfile(TRUTH, engine="vllm", model="m", block_size=32, machine="here", measured_at="now", source="test",
                      prefill_points=((128, 0.01), (512, 0.03)), decode_points=((1, 256, 0.01),),
                      fit_error={"prefill": 0.01, "decode": 0.02})
    path = tmp_path / "sub" / "p.json"
    save_profile(p, path)
    assert load_profile(str(path)) == p
    assert not list(path.parent.glob("*.partial"))
    assert '[128, 0.01]' in path.read_text()  # one point per line, readable


def test_the_fit_finds_the_coefficients_through_noise() -> None:
    rng = random.Random(3)
    noisy = lambda s: s * (1 + rng.uniform(-0.01, 0.01))  # noqa: E731
    prefill = [(n, noisy(TRUTH.prefill_s(n))) for n in (64, 256, 1024, 4096) for _ in range(3)]
    decode = [(b, c, noisy(TRUTH.decode_step_s(b, b * c))) for b in (1, 8, 32, 128) for c in (256, 4096)]
    fitted = fit_cost_model(prefill, decode)
    assert fitted.prefill_per_token_s == pytest.approx(TRUTH.prefill_per_token_s, rel=0.1)
    assert fitted.decode_base_s == pytest.approx(TRUTH.decode_base_s, rel=0.05)
    assert fitted.decode_per_context_token_s == pytest.approx(TRUTH.decode_per_context_token_s, rel=0.2)
    for n in (100, 2000, 6000):
        assert fitted.prefill_s(n) == pytest.approx(TRUTH.prefill_s(n), rel=0.05)
    errors = fit_error(fitted, prefill, decode)
    assert errors["prefill"] < 0.02 and errors["decode"] < 0.02


def test_a_term_the_points_do_not_show_is_zero_not_negative() -> None:
    flat = CostModel(0.004, 30e-6, 0.0, 0.010, 60e-6, 0.0)
    prefill = [(n, flat.prefill_s(n)) for n in (64, 256, 1024)]
    decode = [(b, c, flat.decode_step_s(b, 0) * (0.999 if c > 1000 else 1.0)) for b in (1, 8, 32) for c in (256, 4096)]
    fitted = fit_cost_model(prefill, decode)
    assert fitted.decode_per_context_token_s == 0.0
    assert all(v >= 0 for v in fitted.to_dict().values())


def test_one_context_fits_the_batch_term_alone() -> None:
    decode = [(b, 512, TRUTH.decode_step_s(b, b * 512)) for b in (1, 8, 32, 128)]
    prefill = [(n, TRUTH.prefill_s(n)) for n in (64, 256, 1024)]
    fitted = fit_cost_model(prefill, decode)
    assert fitted.decode_per_context_token_s == 0.0  # it cannot be told from the per-sequence cost here
    assert fitted.decode_step_s(64, 0) == pytest.approx(TRUTH.decode_step_s(64, 64 * 512), rel=0.01)


def test_too_few_points_or_cached_prompts_are_refused() -> None:
    decode = [(b, 256, TRUTH.decode_step_s(b, b * 256)) for b in (1, 8, 32)]
    with pytest.raises(ProfileError, match="prefill points at 3 or more"):
        fit_cost_model([(64, 0.01), (128, 0.012)], decode)
    with pytest.raises(ProfileError, match="no cost per prompt token"):
        fit_cost_model([(64, 0.01), (128, 0.01), (256, 0.01)], decode)


@pytest.mark.parametrize("text, message", [
    ("{", "not JSON"),
    ('{"format": "something-else"}', "not a worker profile"),
    (json.dumps({"format": FORMAT, "cost_model": {}}), "missing coefficient"),
    (json.dumps({"format": FORMAT, "cost_model": TRUTH.to_dict() | {"warp": 1}}), "unknown coefficient 'warp'"),
    (json.dumps({"format": FORMAT, "cost_model": TRUTH.to_dict() | {"decode_base_s": -1}}), "decode_base_s must be"),
    (json.dumps({"format": FORMAT, "cost_model": TRUTH.to_dict(), "prefill_points": [[1, "x"]]}), "malformed"),
])
def test_a_bad_profile_file_says_what_is_wrong(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(ProfileError, match=message):
        load_profile(str(path))


def test_an_unknown_name_lists_the_presets() -> None:
    with pytest.raises(ProfileError, match="presets are .*h100-8b"):
        load_profile("tpu-v9")
    with pytest.raises(ProfileError, match="cannot read"):
        load_profile("/no/such/dir/profile.json")


def test_the_mocker_runs_a_profile_as_its_timing(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    save_profile(WorkerProfile(TRUTH), path)
    t = TimingModel.of_profile(str(path), speedup=2.0)
    assert t.step_seconds([1000], 8, 8 * 300) == pytest.approx(TRUTH.step_s([1000], 8, 8 * 300) / 2)
    assert t.prefill_per_token_us == pytest.approx(30.0)


def test_a_scaled_profile_scales_its_points_too() -> None:
    p = load_profile("large-gpu-8b").scaled(0.5, "half")
    base = load_profile("large-gpu-8b")
    assert p.cost.decode_base_s == pytest.approx(base.cost.decode_base_s / 2)
    assert p.prefill_points[0][1] == pytest.approx(base.prefill_points[0][1] / 2)
    assert p.source.endswith("half")
    with pytest.raises(ProfileError):
        TRUTH.scaled(0)


def test_adapter_loads_of_two_sizes_fit_the_base_and_the_rate() -> None:
    # 30 ms + 0.8 s per GB, measured at 100 MB and 400 MB.
    loads = [(100_000_000, 0.03 + 0.08), (100_000_000, 0.03 + 0.08), (400_000_000, 0.03 + 0.32)]
    base, per_gb = fit_adapter_load(loads)
    assert base == pytest.approx(0.03, abs=1e-6)
    assert per_gb == pytest.approx(0.8, abs=1e-6)


def test_adapter_loads_of_one_size_keep_the_default_rate() -> None:
    base, per_gb = fit_adapter_load([(1_000_000, 0.05), (1_000_000, 0.07), (1_000_000, 0.06)])
    assert per_gb == ADAPTER_LOAD_S_PER_GB
    assert base == pytest.approx(0.06 - 0.001 * ADAPTER_LOAD_S_PER_GB)
    with pytest.raises(ProfileError):
        fit_adapter_load([])


def test_a_profile_keeps_its_adapter_load_cost(tmp_path: Path) -> None:
    cost = replace(load_profile(DEFAULT_PRESET).cost, adapter_load_base_s=0.1, adapter_load_s_per_gb=3.0)
    path = tmp_path / "p.json"
    save_profile(WorkerProfile(cost, engine="mocker", model="m", block_size=16), path)
    assert load_profile(str(path)).cost.adapter_load_s(2_000_000_000) == pytest.approx(6.1)
