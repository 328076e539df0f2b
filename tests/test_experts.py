"""Expert placement: router counts, planners, plan metrics, load files, the demo builder, bad input, and a
2-process gloo run of expert parallelism checked against single-process execution."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from infer_tune.errors import ConfigError, ModelError
from infer_tune.tuners.experts import loadfile, plan_metrics, planners, routing

runner = CliRunner()
TINY = dict(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
            max_position_embeddings=64)


def tiny_moe(arch: str):
    import transformers as T

    configs = {
        "mixtral": lambda: T.MixtralConfig(**TINY, intermediate_size=16, num_local_experts=6, num_experts_per_tok=2),
        "qwen2_moe": lambda: T.Qwen2MoeConfig(**TINY, intermediate_size=32, moe_intermediate_size=16,
                                              shared_expert_intermediate_size=16, num_experts=6,
                                              num_experts_per_tok=2),
        "olmoe": lambda: T.OlmoeConfig(**TINY, intermediate_size=16, num_experts=6, num_experts_per_tok=2),
        "deepseek_v3": lambda: T.DeepseekV3Config(
            **TINY, intermediate_size=32, moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=2,
            n_group=2, topk_group=1, first_k_dense_replace=0, q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8,
            qk_nope_head_dim=8, v_head_dim=8, n_shared_experts=1,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        "gpt_oss": lambda: T.GptOssConfig(**TINY, intermediate_size=16, num_local_experts=4, num_experts_per_tok=2,
                                          head_dim=8, layer_types=["full_attention"] * 2),
    }
    torch.manual_seed(0)
    return T.AutoModelForCausalLM.from_config(configs[arch]()).eval()


# --------------------------------------------------------------------------- router counts
def test_router_counts_equal_a_hand_computed_top_k():
    model = tiny_moe("mixtral")
    routers = [layer.mlp.gate for layer in model.model.layers]
    seen: list[torch.Tensor] = []
    hooks = [r.register_forward_pre_hook(lambda _m, a: seen.append(a[0].reshape(-1, 32).clone())) for r in routers]
    layers = routing.find_moe_layers(model)
    recorder = routing.RoutingRecorder(layers)
    ids = torch.randint(0, 100, (3, 11), generator=torch.Generator().manual_seed(2))
    with recorder, torch.no_grad():
        model(ids)
    for hook in hooks:
        hook.remove()
    for i, (router, x) in enumerate(zip(routers, seen)):
        probs = torch.softmax(x @ router.weight.T, dim=-1)
        top = torch.topk(probs, 2, dim=-1).indices
        counts = np.bincount(top.flatten().numpy(), minlength=6)
        pairs = np.zeros((6, 6), dtype=np.int64)
        for a, b in top.tolist():
            pairs[a, b] += 1
            pairs[b, a] += 1
        assert recorder.counts[i].tolist() == counts.tolist()
        assert np.array_equal(recorder.coactivation[i], pairs)
        assert recorder.routes[i] == Counter(tuple(sorted(row)) for row in top.tolist())
        assert recorder.tokens[i] == 33


@pytest.mark.parametrize("arch", ["qwen2_moe", "olmoe", "deepseek_v3", "gpt_oss"])
def test_every_architecture_is_found_and_counted(arch):
    model = tiny_moe(arch)
    layers = routing.find_moe_layers(model)
    assert len(layers) == 2
    recorder = routing.RoutingRecorder(layers)
    with recorder, torch.no_grad():
        model(torch.randint(0, 100, (2, 9)))
    assert recorder.top_k == 2
    assert recorder.counts.sum(1).tolist() == [2 * 18, 2 * 18]
    for co in recorder.coactivation:
        assert np.array_equal(co, co.T) and not np.diag(co).any() and co.sum() == 2 * 18  # one pair per token


def test_padding_rows_are_not_counted():
    model = tiny_moe("qwen2_moe")
    layers = routing.find_moe_layers(model)
    batch = {"input_ids": torch.randint(0, 100, (2, 6)), "attention_mask": torch.tensor([[0, 0, 1, 1, 1, 1]] * 2)}
    recorder = routing.profile_batches(model, [batch], layers)
    assert recorder.tokens == [8, 8] and recorder.counts.sum() == 2 * 8 * 2


def test_dense_model_has_no_experts(tiny_loaded):
    with pytest.raises(ConfigError, match="has no experts"):
        routing.require_moe(tiny_loaded.model, "tiny-llama")


# --------------------------------------------------------------------------- load files and planners
def synthetic_load(experts: int = 8, layers: int = 2, top_k: int = 2, tokens: int = 2000, skew: float = 0.3,
                   clusters: int | None = None, seed: int = 0) -> loadfile.LoadFile:
    """Skewed routing; with `clusters`, each token picks its experts within one cluster (co-activation)."""
    rng = np.random.default_rng(seed)
    entries = []
    for index in range(layers):
        p = rng.dirichlet(np.full(experts, skew))
        routes: Counter = Counter()
        for _ in range(tokens):
            if clusters:
                size = experts // clusters
                c = rng.integers(clusters)
                members = np.arange(c * size, (c + 1) * size)
                q = p[members] / p[members].sum()
                chosen = rng.choice(members, top_k, replace=False, p=q)
            else:
                chosen = rng.choice(experts, top_k, replace=False, p=p)
            routes[tuple(sorted(int(e) for e in chosen))] += 1
        counts = np.zeros(experts, dtype=np.int64)
        pairs = np.zeros((experts, experts), dtype=np.int64)
        for experts_set, n in routes.items():
            counts[list(experts_set)] += n
            for a in experts_set:
                for b in experts_set:
                    if a != b:
                        pairs[a, b] += n
        entries.append(loadfile.LayerLoad(f"layer{index}", counts, pairs, sorted(routes.items())))
    info = loadfile.ModelInfo(ref="synthetic", path="-", model_type="test", num_experts=experts, top_k=top_k,
                              hidden_size=64, dtype_bytes=4, expert_bytes=1000, dense_bytes=50_000, dtype="float32")
    return loadfile.LoadFile(model=info, layers=entries, workload={"suite": "synthetic"}, tokens=tokens,
                             route_tokens=tokens)


def test_load_file_round_trip_and_malformed_files(tmp_path):
    load = synthetic_load()
    path = load.save(tmp_path / "load.json")
    back = loadfile.load(path)
    assert np.array_equal(back.loads(), load.loads()) and back.layers[1].routes == load.layers[1].routes
    doc = json.loads(path.read_text())
    bad = [("not json {", "not valid JSON"), (json.dumps({"kind": "x"}), "not an expert load file")]
    broken = json.loads(json.dumps(doc))
    broken["layers"][0]["counts"] = [1, 2]
    bad.append((json.dumps(broken), "counts must be a list of 8"))
    broken = json.loads(json.dumps(doc))
    broken["layers"][0]["coactivation"][0][1] += 1
    bad.append((json.dumps(broken), "symmetric"))
    broken = json.loads(json.dumps(doc))
    broken["layers"][0]["routes"][0][0] = [0, 99]
    bad.append((json.dumps(broken), "outside"))
    for i, (text, message) in enumerate(bad):
        file = tmp_path / f"bad{i}.json"
        file.write_text(text)
        with pytest.raises(ConfigError, match=message):
            loadfile.load(file)


@pytest.mark.parametrize("strategy", planners.STRATEGIES)
@pytest.mark.parametrize(("speeds", "slots", "replicas"), [([1, 1, 0.5, 0.5], 3, 4), ([1, 0.5], 5, 2)])
def test_planners_place_every_expert_within_capacity(strategy, speeds, slots, replicas):
    load = synthetic_load(experts=8, skew=0.2)
    topo = planners.Topology(devices=len(speeds), speeds=speeds, slots=slots)
    co = np.stack([layer.coactivation for layer in load.layers])
    plan = planners.make_plan(strategy, load.loads(), topo, replicas=replicas, coactivation=co)
    hosts = plan.hosts()  # check_plan already refused two replicas of one expert on one device
    assert (hosts.sum(2) >= 1).all()  # every expert placed in every layer
    assert (hosts.sum(1) <= slots).all()  # slot capacity respected
    expected = replicas if strategy in ("load-balanced", "speed-aware") else 0
    assert plan.replicas == expected and (hosts.sum((1, 2)) == 8 + expected).all()  # replicas counted
    m = plan_metrics.evaluate(plan, load)
    assert m["physical_experts_per_layer"] == 8 + expected and sum(m["device_load_share"]) == pytest.approx(1)


def test_load_balanced_beats_round_robin_on_skewed_loads():
    for seed in range(3):
        load = synthetic_load(experts=16, skew=0.2, seed=seed)
        topo = planners.Topology(devices=4)
        rr = plan_metrics.evaluate(planners.make_plan("round-robin", load.loads(), topo), load)
        lb0 = plan_metrics.evaluate(planners.make_plan("load-balanced", load.loads(), topo), load)
        lb = plan_metrics.evaluate(planners.make_plan("load-balanced", load.loads(), topo, replicas=4), load)
        assert lb0["balancedness"] >= rr["balancedness"]
        assert lb["balancedness"] >= lb0["balancedness"] and lb["balancedness"] > 0.8


def test_speed_aware_balances_time_on_heterogeneous_devices():
    load = synthetic_load(experts=16, skew=0.5)
    topo = planners.Topology(devices=4, speeds=[1, 1, 0.25, 0.25])
    speed = plan_metrics.evaluate(planners.make_plan("speed-aware", load.loads(), topo, replicas=4), load)
    even = plan_metrics.evaluate(planners.make_plan("load-balanced", load.loads(), topo, replicas=4), load)
    assert speed["time_balancedness"] > even["time_balancedness"]
    assert sum(speed["device_load_share"][:2]) > 0.7  # the fast devices take most of the work


def test_locality_keeps_coactivated_experts_together():
    load = synthetic_load(experts=16, skew=2.0, clusters=4, top_k=2)
    topo = planners.Topology(devices=4)
    co = np.stack([layer.coactivation for layer in load.layers])
    rr = plan_metrics.evaluate(planners.make_plan("round-robin", load.loads(), topo), load)
    local = plan_metrics.evaluate(planners.make_plan("locality", load.loads(), topo, coactivation=co), load)
    # round-robin splits every cluster over all devices: two copies from 3 of 4 homes; locality keeps
    # each cluster on one device: one copy from 3 of 4 homes
    assert rr["cross_device_tokens_per_token"] == pytest.approx(1.5)
    assert local["cross_device_tokens_per_token"] == pytest.approx(0.75)
    assert local["alltoall_bytes_per_token"] == pytest.approx(
        2 * 64 * 4 * sum(local["cross_device_tokens_per_token_per_layer"]))


def test_hierarchical_replicas_stay_in_their_node():
    load = synthetic_load(experts=8, skew=0.3)
    topo = planners.Topology(devices=4, nodes=2)
    plan = planners.make_plan("load-balanced", load.loads(), topo, replicas=2)
    for layer in plan.placement:
        node_of = {}
        for d, experts in enumerate(layer):
            for e in experts:
                assert node_of.setdefault(e, d // 2) == d // 2
    assert "cross_node_tokens_per_token" in plan_metrics.evaluate(plan, load)


def test_expected_copies_by_hand():
    topo = planners.Topology(devices=2)
    hosts = np.array([[1, 0], [1, 0], [0, 1], [0, 1]])
    # {0,1} both on device 0: a token homed on 1 sends one copy, homed on 0 none -> 0.5
    assert plan_metrics.expected_copies([((0, 1), 1)], hosts, topo, 2)[0] == pytest.approx(0.5)
    # {0,2} on both devices: one copy from either home -> 1
    assert plan_metrics.expected_copies([((0, 2), 3)], hosts, topo, 2)[0] == pytest.approx(1.0)
    # expert 0 replicated on both devices: `local` routing never leaves the device, `even` half the time
    replicated = np.array([[1, 1], [1, 0], [0, 1], [0, 1]])
    assert plan_metrics.expected_copies([((0,), 1)], replicated, topo, 2, "local")[0] == 0.0
    assert plan_metrics.expected_copies([((0,), 1)], replicated, topo, 2, "even")[0] == pytest.approx(0.5)


def test_topology_and_capacity_errors():
    with pytest.raises(ConfigError, match="one speed per device"):
        planners.Topology(devices=4, speeds=[1, 1])
    load = synthetic_load(experts=8)
    with pytest.raises(ConfigError, match="every device needs at least one"):
        planners.make_plan("round-robin", load.loads(), planners.Topology(devices=9))
    with pytest.raises(ConfigError, match="slots per device"):
        planners.make_plan("load-balanced", load.loads(), planners.Topology(devices=4, slots=2), replicas=4)


# --------------------------------------------------------------------------- demo builder and the model name
def test_moefied_mlp_with_every_expert_on_equals_the_dense_model(tiny_loaded):
    from infer_tune.tuners.experts import demo

    dense = tiny_loaded.model  # hidden 64, intermediate 128
    spec = demo.DemoSpec(experts=4, top_k=4, shared=32)
    rng = np.random.default_rng(0)
    splits = {}
    for i, layer in enumerate(dense.model.layers):
        x = rng.normal(size=(64, 64))
        act = rng.normal(size=(64, 128))
        split = demo.split_layer(x, act, layer.mlp.down_proj.weight.detach().numpy().astype(np.float64), spec, i)
        assert sorted(np.concatenate([split.shared, *split.groups]).tolist()) == list(range(128))
        split.router[:] = 0.0  # equal logits: every expert weighs 1/k, times k
        splits[i] = split
    moe = demo.assemble(dense, splits, spec)
    ids = torch.randint(0, 300, (2, 12))
    with torch.no_grad():
        assert torch.allclose(moe(ids).logits, dense(ids).logits, atol=1e-4, rtol=1e-4)
    assert len(routing.find_moe_layers(moe)) == len(dense.model.layers)


def test_moe_demo_is_a_model_name(monkeypatch, tmp_path):
    from infer_tune import models

    monkeypatch.setenv("INFER_TUNE_HOME", str(tmp_path))
    with pytest.raises(ModelError, match="experts build-demo"):
        models.resolve("moe-demo")
    (tmp_path / "models" / "moe-demo").mkdir(parents=True)
    (tmp_path / "models" / "moe-demo" / "config.json").write_text("{}")
    assert models.resolve("moe-demo") == str(tmp_path / "models" / "moe-demo")


def test_a_cached_moe_demo_is_kept_only_when_built_from_the_same_spec_source_and_builder(monkeypatch, tmp_path):
    from infer_tune import atomic
    from infer_tune.tuners.experts import demo

    monkeypatch.setenv("INFER_TUNE_HOME", str(tmp_path))
    source = tmp_path / "models" / "smollm2-135m"
    source.mkdir(parents=True)
    (source / "config.json").write_text("{}")
    (source / "model.safetensors").write_bytes(b"weights one")
    built = tmp_path / "models" / "moe-demo"
    built.mkdir()
    (built / "config.json").write_text("{}")
    (built / "model.safetensors").write_bytes(b"moe")
    spec = demo.DemoSpec()
    atomic.write_json(built / "infer_tune_source.json", {"built": {"experts": 16}, "key": demo.build_key(spec)})

    def no_load(*args, **kwargs):
        raise AssertionError("a cached build was built again")

    monkeypatch.setattr(demo.models, "load", no_load)
    facts = demo.build(spec, rebuild=False)
    assert facts["cached"] is True and facts["experts"] == 16 and facts["path"] == str(built)
    with pytest.raises(AssertionError, match="built again"):  # --rebuild builds whatever is cached
        demo.build(spec, rebuild=True)
    assert demo.cached_build(demo.DemoSpec(experts=8)) is None  # another spec
    monkeypatch.setattr(demo, "BUILDER_VERSION", demo.BUILDER_VERSION + 1)
    assert demo.cached_build(spec) is None  # another builder
    monkeypatch.setattr(demo, "BUILDER_VERSION", demo.BUILDER_VERSION - 1)
    assert demo.cached_build(spec) is not None
    (source / "model.safetensors").write_bytes(b"weights two")  # other source bytes
    assert demo.cached_build(spec) is None


# --------------------------------------------------------------------------- end to end: profile, plan, validate
@pytest.fixture(scope="module")
def tiny_moe_dir(tmp_path_factory) -> Path:
    """A random Qwen2-MoE checkpoint (8 experts, top-2, a shared expert) with the tiny tokenizer."""
    from conftest import build_tiny_tokenizer
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    path = tmp_path_factory.mktemp("tiny-moe")
    tokenizer = build_tiny_tokenizer()
    config = Qwen2MoeConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                            shared_expert_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                            qkv_bias=False, max_position_embeddings=1024, pad_token_id=tokenizer.pad_token_id,
                            eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    torch.manual_seed(0)
    model = Qwen2MoeForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0, 1.0)  # spread the routing: a random init routes almost uniformly
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _spec(model_dir: Path, prompts_file: Path, out: Path):
    from infer_tune.scenarios.common import RunSpec
    from infer_tune.workload import Protocol, Workload

    return RunSpec(model=str(model_dir), workload=Workload(suite=str(prompts_file), limit=4, max_new_tokens=6),
                   protocol=Protocol(warmup=0, min_iterations=1, min_duration_s=0), threads=2, out_dir=out,
                   measure_ppl=False)


def test_two_process_expert_parallelism_matches_single_process(tiny_moe_dir, prompts_file, tmp_path):
    from infer_tune import models
    from infer_tune.cli import app
    from infer_tune.results import find_results
    from infer_tune.scenarios.experts import run_plan, run_profile, run_validate
    from infer_tune.tuners.experts.worker import assign_batches
    from infer_tune.workload import prepare_inputs

    spec = _spec(tiny_moe_dir, prompts_file, tmp_path / "runs")
    profile = run_profile(spec, save=tmp_path / "load.json")
    assert profile.heatmap.read_bytes()[:4] == b"\x89PNG"
    assert profile.load.model.num_experts == 8 and profile.load.model.top_k == 2
    plans = run_plan(profile.path, devices=2, strategies=["round-robin", "load-balanced"], replicas=2,
                     save=tmp_path / "plans.json", out_dir=tmp_path / "runs")
    assert [d["config"]["strategy"] for d in plans.docs] == ["round-robin", "load-balanced"]
    assert (plans.docs[0].location / "plan_loads.png").is_file()

    outcome = run_validate(spec, tmp_path / "plans.json", procs=2)
    for doc in outcome.docs:
        m = doc["metrics"]
        assert doc["runner"] == "multiprocess" and m["procs"] == 2
        assert m["within_tolerance"] and m["top1_agreement"] == 1.0  # teacher-forced pass vs the unsharded model
        assert m["generation_mismatches"] == 0 and m["outputs_match_single_process"]
        assert m["output_mismatches"] == 0  # greedy outputs vs the single-process baseline run
        assert m["tpot_ms"]["n"] == 4 and m["generated_tokens"] > 0  # per-token timings came back from the ranks
        assert m["expert_bytes_per_rank"][0] < profile.load.model.expert_bytes * 8 * 2  # each rank keeps a share

    # round-robin: the bytes sent equal a count by hand (expert e on device e mod 2; prompts on ranks balanced
    # by tokens)
    loaded = models.load(str(tiny_moe_dir))
    layers = routing.find_moe_layers(loaded.model)
    inputs = prepare_inputs(loaded, spec.workload)
    home = {b: r for r, batches in enumerate(assign_batches([int(b["attention_mask"].sum()) for b in inputs.batches], 2))
            for b in batches}
    expected_rows = 0
    for b, batch in enumerate(inputs.batches):
        recorder = routing.profile_batches(loaded.model, [batch], layers)
        for routes in recorder.routes:
            expected_rows += sum(n * len({e % 2 for e in experts} - {home[b]}) for experts, n in routes.items())
    rr = outcome.docs[0]["metrics"]
    assert rr["prefill_remote_rows"] == expected_rows
    assert rr["prefill_payload_bytes"] == 2 * expected_rows * 64 * 4
    assert rr["prefill_tokens"] == 2 * profile.load.tokens  # two MoE layers
    assert abs(rr["alltoall_bytes_per_token_vs_predicted_pct"]) < 25  # same tokens; homes differ from the uniform mix

    assert len(find_results(tmp_path / "runs")) == 2 + 1 + 2  # plans, single-process baseline, validations
    gate = ["--fail-if", "balancedness < -5%"]
    rr_plan, lb_plan = (str(d.location) for d in plans.docs)
    assert runner.invoke(app, ["compare", rr_plan, lb_plan, *gate]).exit_code == 0
    worse = plans.docs[1]["metrics"]["balancedness"] > 1.06 * plans.docs[0]["metrics"]["balancedness"]
    assert runner.invoke(app, ["compare", lb_plan, rr_plan, *gate]).exit_code == (1 if worse else 0)
    board = runner.invoke(app, ["leaderboard", str(tmp_path / "runs"), "--json"])
    assert board.exit_code == 0 and json.loads(board.output)["rows"]


def test_bad_input_exits_2_and_writes_nothing(tiny_model_dir, tiny_moe_dir, prompts_file, tmp_path):
    from infer_tune.cli import app

    out = tmp_path / "runs"
    dense = runner.invoke(app, ["experts", "profile", "--model", str(tiny_model_dir), "--suite", str(prompts_file),
                                "--limit", "2", "--out", str(out)])
    assert dense.exit_code == 2 and "has no experts" in dense.output
    load = synthetic_load(experts=8).save(tmp_path / "load.json")
    (tmp_path / "broken.json").write_text('{"kind": "infer-tune-expert-load", "version": 1}')
    cases = [
        (["--load", str(load), "--devices", "9"], "every device needs at least one"),
        (["--load", str(tmp_path / "broken.json")], "malformed"),
        (["--load", str(load), "--devices", "4", "--device-speeds", "1,1"], "one per device"),
        (["--load", str(load), "--memory-per-device", "lots"], "size like"),
        (["--load", str(load), "--devices", "4", "--memory-per-device", "51000"], "does not hold"),
        (["--load", str(load), "--devices", "4", "--memory-per-device", "53kB"], "allows 1"),
    ]
    for args, message in cases:
        result = runner.invoke(app, ["experts", "plan", *args, "--out", str(out)])
        assert result.exit_code == 2 and message in result.output, (args, result.output)
    assert not out.exists()
    plans = tmp_path / "plans.json"
    assert runner.invoke(app, ["experts", "plan", "--load", str(load), "--devices", "2", "--save", str(plans),
                               "--out", str(out)]).exit_code == 0
    wrong = runner.invoke(app, ["experts", "validate", "--model", str(tiny_moe_dir), "--suite", str(prompts_file),
                                "--plan", str(plans), "--procs", "4", "--out", str(tmp_path / "v")])
    assert wrong.exit_code == 2 and "not 4" in wrong.output
    assert not (tmp_path / "v").exists()
