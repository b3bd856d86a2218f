"""Mixtures (weights, schedules, exact position, process-count independence) and packing
(windows, segment ids, no attention across documents, positions reset per segment)."""

import numpy as np
import pytest

from jtrain import config as config_lib
from jtrain.data import Mixture, make_sources, make_train_iterator, mixture, packing
from jtrain.errors import DataError


def _docs(n, seed, offset=0, low=3, high=30):
    r = np.random.default_rng(seed)
    return [(r.integers(0, 20, r.integers(low, high)) + offset).astype(np.int32)
            for _ in range(n)]


def _cfg(**data):
    return config_lib.resolve({"data": {"batch_size": 8, "seq_len": 16, "val_fraction": 0.0,
                                        **data}}).data


def _plan(sizes, weights, schedule=None, *, batch=64, local=64, p=0, seed=3):
    names = [f"c{i}" for i in range(len(sizes))]
    src = mixture.ConcatSource([np.zeros(n) for n in sizes], names)
    starts, table = mixture.schedule_table(names, dict(zip(names, weights, strict=True)),
                                           schedule or {})
    return mixture.MixturePlan(src, starts, table, global_batch=batch, local_batch=local,
                               process_index=p, seed=seed, shuffle=True)


def _components(plan, numbers):
    out = []
    for b in numbers:
        _, _, idx, _ = plan(b)
        out.append([plan.source.locate(i)[0] for i in idx])
    return np.array(out)


def _within_binomial(counts, n, p):
    sd = np.sqrt(n * p * (1 - p))
    assert abs(counts - n * p) <= 5 * sd + 1, (counts, n * p, sd)


def test_realized_proportions_follow_the_weights_and_the_schedule():
    plan = _plan([50, 70, 30], [0.6, 0.3, 0.1], {"40": {"c0": 0.1, "c1": 0.1, "c2": 0.8}})
    before = _components(plan, range(40)).ravel()
    after = _components(plan, range(40, 80)).ravel()
    for c, w in enumerate([0.6, 0.3, 0.1]):
        _within_binomial(np.sum(before == c), before.size, w)
    for c, w in enumerate([0.1, 0.1, 0.8]):
        _within_binomial(np.sum(after == c), after.size, w)


def test_each_component_runs_through_its_own_epochs_every_example_once():
    plan = _plan([20, 500], [0.5, 0.5], batch=10, local=10)
    seen = [plan.source.locate(i) for b in range(8) for i in plan(b)[2]]  # 80 draws
    small = [(e, i) for c, e, i in seen if c == 0]
    by_epoch = {}
    for e, i in small:
        by_epoch.setdefault(e, []).append(i)
    assert sorted(by_epoch[0]) == list(range(20))  # a full epoch of 20, no repeats
    assert len(set(by_epoch.get(1, []))) == len(by_epoch.get(1, []))


def test_the_global_batch_does_not_depend_on_the_process_count():
    one = _plan([33, 17], [0.7, 0.3], batch=8, local=8)
    halves = [_plan([33, 17], [0.7, 0.3], batch=8, local=4, p=p) for p in (0, 1)]
    for b in (0, 1, 5, 300, 301):  # across a chunk boundary too
        whole = one(b)[2]
        assert np.array_equal(whole, np.concatenate([h(b)[2] for h in halves]))


def _mix_data():
    docs = {"a": {"inputs": np.arange(40, dtype=np.float32)[:, None],
                  "targets": np.zeros(40, np.int32)},
            "b": {"inputs": -np.arange(1, 31, dtype=np.float32)[:, None],
                  "targets": np.ones(30, np.int32)}}
    return Mixture(docs, weights={"a": 0.5, "b": 0.5})


def test_iterator_resumes_exactly_and_records_draws_and_epochs():
    train, _, info = make_sources(_cfg(), _mix_data())
    assert info["mixture"][0] == {"name": "a", "weight": 0.5, "examples": 40}

    def it():
        return make_train_iterator(train, local_batch=8, seed=1, shuffle=True,
                                   process_index=0, process_count=1)

    ref = it()
    batches = [next(ref)["inputs"].copy() for _ in range(12)]
    again = it()
    for _ in range(5):
        next(again)
    state = again.get_state()
    assert state["kind"] == "mixture" and sum(state["draws"]) == 40
    resumed = it()
    resumed.set_state(state)
    for want in batches[5:]:
        assert np.array_equal(next(resumed)["inputs"], want)
    end = resumed.get_state()
    assert end["epochs"] == [d // n for d, n in zip(end["draws"], end["sizes"], strict=True)]
    assert sum(end["draws"]) == 96


def test_report_gives_each_components_weight_draws_and_epochs():
    train, _, info = make_sources(_cfg(mixture_schedule={3: {"a": 1.0}}), _mix_data())
    assert info["components"] == ("mixture of 2: a (0.50, 40 examples), "
                                  "b (0.50, 30 examples)")
    it = make_train_iterator(train, local_batch=8, seed=1, shuffle=True, process_index=0,
                             process_count=1)
    for _ in range(7):
        next(it)
    state = it.get_state()
    block = mixture.report(state, train.schedule)
    assert list(block) == ["a", "b"]  # the weights in force at the last batch (step 6)
    assert [c["weight"] for c in block.values()] == [1.0, 0.0]
    assert [c["draws"] for c in block.values()] == state["draws"]
    assert [c["size"] for c in block.values()] == [40, 30]
    assert block["a"]["epochs"] == round(state["draws"][0] / 40, 3)
    assert mixture.report({"kind": "map", "position": 3}, train.schedule) is None
    line = mixture.report_line(block, 7)
    assert line.startswith("jtrain: mixture over 7 batches: a ") and " drawn (" in line


def test_mixture_header_names_the_components_not_batches_per_epoch():
    from jtrain.observe import header

    text = header.run_header(model="m", num_params=1, precision="f32", mesh_shape={"data": 1},
                             data_name="mixture", train_size=60, eval_size=0, global_batch=8,
                             workdir="w", origin="fresh start",
                             components="mixture of 2: a (0.50, 40 examples), b (0.50, 20 "
                                        "examples)")
    line = next(ln for ln in text.splitlines() if ln.startswith("jtrain: data "))
    assert line.endswith("global batch 8, mixture of 2: a (0.50, 40 examples), b (0.50, "
                         "20 examples)") and "per epoch" not in text


def test_components_that_disagree_fail_naming_the_component():
    bad = Mixture({"a": {"inputs": np.zeros((10, 3), np.float32), "targets": np.zeros(10)},
                   "b": {"inputs": np.zeros((10, 4), np.float32), "targets": np.zeros(10)}})
    with pytest.raises(DataError, match=r"data\.mixture\.b.*inputs"):
        make_sources(_cfg(), bad)
    with pytest.raises(DataError, match="unknown components"):
        make_sources(_cfg(mixture_schedule={5: {"zzz": 1.0}}), _mix_data())
    with pytest.raises(DataError, match="positive sum"):
        make_sources(_cfg(), Mixture(_mix_data().components, weights={"a": 0, "b": 0}))


def test_packing_covers_every_pair_once_with_segments_and_positions():
    docs = _docs(60, 0)
    pairs = sum(len(d) - 1 for d in docs)
    fill = {}
    for mode in ("pad", "concat", "first_fit"):
        p = packing.Packed(docs, 16, mode, name="d", seed=0, buffer=8)
        items = [p[i] for i in range(len(p))]
        assert sum(int(it["weights"].sum()) for it in items) == pairs
        for it in items:
            seg, pos = it["segment_ids"], it["positions"]
            assert np.all((seg > 0) == (it["weights"] > 0))
            for s in set(seg[seg > 0].tolist()):
                assert np.array_equal(pos[seg == s], np.arange(np.sum(seg == s)))
        fill[mode] = p.fill()
    assert fill["pad"] < fill["first_fit"] and fill["concat"] == pytest.approx(
        pairs / (16 * -(-pairs // 16)))
    again = packing.Packed(docs, 16, "first_fit", name="d", seed=0, buffer=8)
    assert again.windows == packing.Packed(docs, 16, "first_fit", name="d", seed=0,
                                           buffer=8).windows
    first = packing.Packed(docs, 16, "first_fit", name="d", seed=0, buffer=8)[0]
    # targets never cross a document: each target is the next token of the same document
    for s in set(first["segment_ids"][first["segment_ids"] > 0].tolist()):
        ins, tg = first["inputs"][first["segment_ids"] == s], first["targets"][
            first["segment_ids"] == s]
        assert np.array_equal(ins[1:], tg[:-1])


def test_packing_rejects_what_is_not_token_documents():
    with pytest.raises(DataError, match="1-D integer"):
        packing.Packed([np.zeros((3, 2), np.int32)], 8, "concat", name="d")
    with pytest.raises(DataError, match="map-style"):
        packing.Packed(iter([]), 8, "concat", name="d")


@pytest.mark.slow  # seconds of CPU: the full suite runs it (tests/README.md)
def test_transformer_masks_across_segments_and_resets_positions():
    import jax
    import jax.numpy as jnp

    from jtrain.models.transformer import Transformer

    model = Transformer(vocab_size=32, d_model=16, num_layers=2, num_heads=2, d_ff=32,
                        max_len=16, dropout=0.0, tie_embeddings=True)
    a, b = np.arange(1, 7, dtype=np.int32), np.array([9, 3, 5, 7, 2], np.int32)
    seg = np.array([[1] * 6 + [2] * 5 + [0] * 5])
    pos = np.array([list(range(6)) + list(range(5)) + [0] * 5])

    def packed(first):
        toks = np.concatenate([first, b, np.zeros(5, np.int32)])[None]
        return {"inputs": jnp.asarray(toks), "segment_ids": jnp.asarray(seg),
                "positions": jnp.asarray(pos)}

    params = model.init(jax.random.key(0), packed(a))
    out = model.apply(params, packed(a))
    changed = model.apply(params, packed(np.array([4, 4, 4, 4, 4, 4], np.int32)))
    assert not np.allclose(out[0, :6], changed[0, :6])
    np.testing.assert_allclose(out[0, 6:11], changed[0, 6:11], rtol=1e-5, atol=1e-6)
    alone = model.apply(params, jnp.asarray(b[None]))  # b at the start of a window
    np.testing.assert_allclose(out[0, 6:11], alone[0], rtol=1e-5, atol=1e-5)


def test_the_draws_depend_on_the_seed():
    one, same, other = (_plan([50, 70], [0.5, 0.5], batch=16, local=16, seed=s)
                        for s in (1, 1, 2))
    assert np.array_equal(one.choices(0), same.choices(0))
    assert not np.array_equal(one.choices(0), other.choices(0))  # which component
    assert not np.array_equal(one.order(1, 0), other.order(1, 0))  # which example
    assert not np.array_equal(one(0)[2], other(0)[2])


def test_a_schedule_switches_at_its_step_not_a_batch_later():
    # weights 1 / 0: every slot's component is decided; batch number b is what the
    # step at schedule position b trains on (the loop's batch_of)
    for at in (1, 5, 255, 256, 257):  # across the chunk boundary (CHUNK = 256) too
        plan = _plan([10, 10], [1.0, 0.0], {at: {"c1": 1.0}}, batch=4, local=4)
        assert plan.row(at - 1).tolist() == [0] * 4, at
        assert plan.row(at).tolist() == [1] * 4, at
        starts, table = plan.starts, plan.table
        assert mixture.report({"kind": "mixture", "position": at, "components": ["c0", "c1"],
                               "sizes": [10, 10], "draws": [0, 0], "epochs": [0, 0]},
                              (starts, table))["c1"]["weight"] == 0.0  # last batch at-1
        assert mixture.report({"kind": "mixture", "position": at + 1,
                               "components": ["c0", "c1"], "sizes": [10, 10],
                               "draws": [0, 0], "epochs": [0, 0]},
                              (starts, table))["c1"]["weight"] == 1.0


def test_no_packed_target_crosses_a_document_not_even_the_last_of_a_segment():
    # token = 1000 * document + position: a target is its input + 1 in the same document
    r = np.random.default_rng(5)
    docs = [(1000 * (d + 1) + np.arange(r.integers(2, 40))).astype(np.int32)
            for d in range(40)]
    for mode in ("pad", "concat", "first_fit"):
        p = packing.Packed(docs, 16, mode, name="d", seed=0, buffer=4)
        for i in range(len(p)):
            it = p[i]
            on = it["weights"] > 0
            assert np.array_equal(it["targets"][on], it["inputs"][on] + 1), (mode, i)
            last = on & (np.append(it["segment_ids"][1:], 0) != it["segment_ids"])
            assert last.sum() == len(set(it["segment_ids"][on].tolist()))  # checked too
