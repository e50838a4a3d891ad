"""The autotuner's best-config cache, default config table and progress bar (issue 21 item 5).

Properties (hypothesis): the cache key separates every (arguments, dtypes, configs, target, machine)
and is stable for equal ones; whatever bytes a cache file holds, a call returns one of the listed
configs, and a record that is not valid for its key is re-tuned and replaced (never used).
Runs on the interpreter target (timing is real, compile is instant), so each example costs milliseconds.
"""

import json
import math

import pytest
import tilehal
import tilelang
import tilelang.language as T
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tilelang.runtime import autotune as at

CONFIGS = [{"block": 8}, {"block": 32}, {"block": 16}]
FAST = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                       HealthCheck.too_slow])


def make(configs=CONFIGS, defaults=None, target="interp"):
    @tilelang.autotune(configs=configs, warmup=0.2, rep=0.5, progress=False, defaults=defaults,
                       ref_prog=lambda x: x * 3.0, atol=1e-6)
    @tilelang.jit(out_idx=[1], target=target)
    def scale(n, dtype="float32", block=16):
        @T.prim_func
        def main(X: T.Tensor((n,), dtype), Y: T.Tensor((n,), dtype)):
            with T.Kernel(T.ceildiv(n, block)) as bx:
                for i in T.Parallel(block):
                    if bx * block + i < n:
                        Y[bx * block + i] = X[bx * block + i] * 3.0

        return main

    return scale


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TILESTACK_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(at.ENV, raising=False)
    return tmp_path / "tilelang_autotune"


def _files(cache):
    return sorted(cache.glob("*.json")) if cache.exists() else []


# ---------------------------------------------------------------- keys

calls = st.tuples(st.integers(1, 64), st.sampled_from(["float32", "float16"]),
                  st.permutations(CONFIGS).map(lambda c: [dict(x) for x in c[:2]]),
                  st.sampled_from(["interp", "cpu"]), st.sampled_from(["cpu|8|avx2", "cpu|8|avx2|H200|sm_90|132",
                                                                       "cpu|8|avx2|H100|sm_90|132"]))


@FAST
@given(calls, calls)
def test_key_separates_and_is_stable(monkeypatch, a, b):
    def key(call):
        n, dtype, configs, target, machine = call
        monkeypatch.setattr(at, "_machine", lambda _t, m=machine: m)
        return make(configs, target=target)._key((n, dtype), {}, configs)

    assert key(a) == key(a)
    assert (key(a) == key(b)) == (json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True))


def test_key_stands_tensors_for_shape_and_dtype():
    import torch

    g = make()
    k1 = g._key((torch.zeros(4, 8),), {}, CONFIGS)
    assert k1 == g._key((torch.ones(4, 8),), {}, CONFIGS)  # values do not matter
    assert k1 != g._key((torch.zeros(4, 9),), {}, CONFIGS)
    assert k1 != g._key((torch.zeros(4, 8, dtype=torch.float16),), {}, CONFIGS)


# ---------------------------------------------------------------- corruption: never a wrong config

json_values = st.recursive(st.none() | st.booleans() | st.floats(allow_nan=True) | st.integers() | st.text(max_size=8),
                           lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=8), kids,
                                                                                      max_size=3), max_leaves=8)


def _mutations(valid: dict):
    fields = st.sampled_from(["format", "key", "config", "latency_ms", "timings"])
    return st.one_of(
        st.binary(max_size=64).map(lambda b: ("bytes", b)),
        json_values.map(lambda v: ("json", json.dumps(v).encode())),
        st.tuples(fields, json_values).map(lambda fv: ("field", json.dumps({**valid, fv[0]: fv[1]}).encode())),
        st.sampled_from(list(valid)).map(lambda f: ("drop", json.dumps({k: v for k, v in valid.items() if k != f})
                                                    .encode())),
    )


def test_cache_corruption_never_gives_a_wrong_config(cache):
    g = make()
    k = g(50)
    assert k.config in CONFIGS and g.last_result.source == "tuned"
    (path,) = _files(cache)
    valid = json.loads(path.read_text())
    assert valid["config"] == k.config and valid["format"] == at.CACHE_FORMAT

    @FAST
    @given(_mutations(valid))
    def run(mutation):
        _, raw = mutation
        path.write_bytes(raw)
        g2 = make()
        k2 = g2(50)
        assert k2.config in CONFIGS  # whatever the file held
        rec = g2._read_cache(path, valid["key"], CONFIGS)
        assert rec is not None and rec["config"] in CONFIGS  # a valid record is back on disk
        if g2.last_result.source == "cache":  # the record was accepted: it passed every check
            m = json.loads(raw)
            assert m["key"] == valid["key"] and m["config"] in CONFIGS and math.isfinite(m["latency_ms"])
        else:
            assert g2.last_result.source == "tuned"
        import numpy as np

        x = np.linspace(-1, 1, 50).astype(np.float32)
        np.testing.assert_allclose(k2(x), x * 3.0, rtol=1e-6)

    run()


def test_cache_record_for_another_key_is_not_used(cache, caplog):
    g = make()
    g(40)
    g(41)
    by_args = {json.loads(p.read_text())["args"]: p for p in _files(cache)}
    by_args["(40,)"].write_text(by_args["(41,)"].read_text())  # n=41's record under n=40's name
    g2 = make()
    with caplog.at_level("WARNING", logger="tilelang.autotune"):
        g2(40)
    assert g2.last_result.source == "tuned" and "another key" in caplog.text
    assert json.loads(by_args["(40,)"].read_text())["args"] == "(40,)"  # replaced by a fresh record


def test_cached_config_outside_candidates_is_refused(cache, caplog):
    g = make()
    g(33)
    (path,) = _files(cache)
    rec = json.loads(path.read_text())
    rec["config"] = {"block": 64}  # well-formed, but not a candidate
    path.write_text(json.dumps(rec))
    g2 = make()
    with caplog.at_level("WARNING", logger="tilelang.autotune"):
        k = g2(33)
    assert k.config in CONFIGS and g2.last_result.source == "tuned" and "not one of the 3 candidates" in caplog.text


# ---------------------------------------------------------------- default config table


def test_default_config_first_call_does_not_tune(cache):
    g = make(defaults={(100,): {"block": 32}, "*": {"block": 8}})
    k = g(100)
    assert k.config == {"block": 32} and g.last_result.source == "default" and math.isnan(k.latency)
    assert _files(cache) == []  # nothing timed, nothing cached
    assert g(7).config == {"block": 8}  # the "*" entry
    k = g.tune(100)  # explicit tuning caches the winner
    assert g.last_result.source == "tuned" and len(g.last_result.timings) == 3 and len(_files(cache)) == 1
    g2 = make(defaults={(100,): {"block": 32}})
    assert g2(100).config == k.config and g2.last_result.source == "cache"


def test_default_config_callable_and_env(cache, monkeypatch):
    g = make(defaults=lambda n, **_: {"block": 16} if n > 10 else None)
    assert g(20).config == {"block": 16} and g.last_result.source == "default"
    g(5)
    assert g.last_result.source == "tuned"  # no default entry: tuned now
    monkeypatch.setenv(at.ENV, "1")
    g2 = make(defaults={"*": {"block": 16}})
    g2(21)
    assert g2.last_result.source == "tuned"
    monkeypatch.setenv(at.ENV, "0")
    g3 = make()
    assert g3(22).config == CONFIGS[0] and g3.last_result.source == "default"


@pytest.mark.parametrize("bad", [{"*": {"blok": 8}}, {"*": 8}])
def test_bad_default_config_is_refused(cache, bad):
    with pytest.raises(tilehal.ArgumentError, match="default config"):
        make(defaults=bad)(12)


def test_defaults_must_be_table_or_callable():
    with pytest.raises(tilehal.ArgumentError, match="defaults must be"):
        make(defaults=[{"block": 8}])


# ---------------------------------------------------------------- progress


def test_progress_without_tqdm(monkeypatch, capsys):
    import builtins

    real = builtins.__import__

    def no_tqdm(name, *a, **k):
        if name.startswith("tqdm"):
            raise ImportError("no tqdm here")
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_tqdm)
    assert list(tilehal.progress(range(3), desc="tuning")) == [0, 1, 2]
    err = capsys.readouterr().err
    assert "tuning: 3/3" in err
    assert list(tilehal.progress(iter([1, 2]), desc="x", disable=True)) == [1, 2]
    assert capsys.readouterr().err == ""


def test_tuning_shows_progress(cache, capsys, monkeypatch):
    import builtins

    real = builtins.__import__
    monkeypatch.setattr(builtins, "__import__",
                        lambda name, *a, **k: (_ for _ in ()).throw(ImportError()) if name.startswith("tqdm")
                        else real(name, *a, **k))

    @tilelang.autotune(configs=CONFIGS, warmup=0.2, rep=0.5, progress=True)
    @tilelang.jit(out_idx=[1], target="interp")
    def copy(n, block=16):
        @T.prim_func
        def main(X: T.Tensor((n,), "float32"), Y: T.Tensor((n,), "float32")):
            with T.Kernel(T.ceildiv(n, block)) as bx:
                for i in T.Parallel(block):
                    if bx * block + i < n:
                        Y[bx * block + i] = X[bx * block + i]

        return main

    copy(30)
    err = capsys.readouterr().err
    assert "autotune copy: compile: 3/3" in err and "autotune copy: bench: 3/3" in err


def test_config_pass_configs_go_to_the_compiler(cache, monkeypatch):
    """A config's "pass_configs" entry reaches tilelang.compile (merged over the factory's), not the factory."""
    seen = []
    real = at.compile

    def spy(func, out_idx=None, target=None, pass_configs=None):
        seen.append(pass_configs)
        return real(func, out_idx=out_idx, target=target, pass_configs=pass_configs)

    monkeypatch.setattr(at, "compile", spy)
    configs = [{"block": 8}, {"block": 8, "pass_configs": {"cuda_persistent": True}}]
    k = make(configs)(24)
    assert k.config in configs and None in seen and {"cuda_persistent": True} in seen
    with pytest.raises(tilehal.ArgumentError, match="pass_configs must be a dict"):
        make([{"block": 8, "pass_configs": 3}]).tune(24)
