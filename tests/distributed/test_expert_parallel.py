"""Expert parallelism with FP8 (issue 30 item 1, fixes/convert/moe_experts.py): a Qwen3-MoE loaded the way transformers 5.x
documents for large MoE models — ``from_pretrained(..., distributed_config=DistributedConfig(fsdp_size=4,
ep_size=2))``: whole experts per EP rank (``Shard(0)`` on ``ep``), FSDP2 over the expert replicas (``efsdp``), the
token dispatch an all-to-all over gloo — then accelerate FSDP2 + fp8 with the package, 4 ranks, against one process.

Each rank's local experts run on TE grouped GEMMs in FP8; their delayed-scaling amaxes are reduced over the ranks
that hold the same experts (``efsdp``), every other module's over the whole mesh. The collective-order audit of the
pool checks that every rank's collectives agree, also when one EP rank gets no tokens at all.
"""

import pytest

from accel_fp8_fix.testing import training
from support import ep_scenarios, scenarios

PLAN = [("sc_ep", {"fp8": True}), ("sc_ep", {"fp8": False}), ("sc_ep", {"fp8": True, "skew": [0, 1]})]
# EP x TP (transformers' DistributedConfig(fsdp_size=2, tp_size=2, ep_size=E): its TP plan on attention, its EP on
# the experts; accelerate FSDP2 2 x TP 2): ep 2 (efsdp 2: each expert on two ranks) and ep 4 (every expert whole on
# one rank: efsdp 1)
EP_TP = [("sc_ep", {"fsdp": 2, "tp": 2, "ep": 2}), ("sc_ep", {"fsdp": 2, "tp": 2, "ep": 4, "steps": 2})]


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    out_dir = str(tmp_path_factory.mktemp("ep_checkpoint"))
    return scenarios.launch(ep_scenarios, _plan4(out_dir), 4)


def _plan4(out_dir):
    return PLAN + [("sc_ep_checkpoint", {"out_dir": out_dir}), ("sc_ep_resize", {"out_dir": out_dir})] + EP_TP


def _facts(launched, kw):
    return scenarios.facts_of(launched, scenarios.key_of(PLAN, "sc_ep", kw))


@pytest.mark.parametrize("kw", [kw for _, kw in PLAN], ids=["fp8", "fp8-off", "fp8-one-ep-rank-idle"])
def test_experts_under_ep_train_like_the_one_process_reference(launched, kw):
    for rank, f in enumerate(_facts(launched, kw)):
        assert f["experts"] == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"], f["skipped"]
        assert not any("experts" in n for n in f["skipped"]), f["skipped"]
        assert (f["ep_rank"], f["local_experts"]) == (rank % 2, 2)
        if kw["fp8"]:  # step 0 to summation order, later steps within FP8 resolution (as FSDP2 without EP)
            assert f["stats"]["fp8_gemms"] > 0 and f["stats"]["non_fp8_gemms"] == 0
            assert f["stats"]["grouped_gemms"] == 12 * ep_scenarios.STEPS  # 2 layers x 2 runners x fwd/dgrad/wgrad
            assert f["losses"][0] == pytest.approx(f["reference"][0], rel=2e-4)
            assert f["losses"] == pytest.approx(f["reference"], rel=1e-2)
            assert f["grad_norms"] == pytest.approx(f["reference_grad_norms"], rel=3e-2)
            assert f["fp8_share_outside_lm_head"] >= 0.9, f["high_precision"]
        else:  # TE autocast off: the converted experts under EP are transformers' fp32 model
            assert f["stats"]["fp8_gemms"] == 0
            assert f["losses"] == pytest.approx(f["reference"], rel=1e-6)
            assert f["grad_norms"] == pytest.approx(f["reference_grad_norms"], rel=1e-5)


@pytest.mark.parametrize("kw", [PLAN[0][1], PLAN[2][1]], ids=["fp8", "fp8-one-ep-rank-idle"])
def test_each_expert_shares_its_scales_with_the_ranks_holding_it_and_no_other_expert(launched, kw):
    """Position i of a rank's GroupedLinear is global expert ep_rank * 2 + i: its amaxes are reduced over the ranks
    holding that expert (efsdp: ranks {0, 2} and {1, 3}), so after step 0 each rank's forward amax histories equal
    the one-process reference's columns of *its* experts bit for bit — and not the other EP rank's experts'."""
    facts = _facts(launched, kw)
    for rank, f in enumerate(facts):
        assert f["expert_group"] == [rank % 2, rank % 2 + 2]
        assert all(f["amax_step0_equal_reference"].values()), f["amax_step0_equal_reference"]
        assert not any(f["amax_step0_equal_other_experts"].values())
        groups = f["stats"]["amax_reduction_groups"]
        assert set(map(str, groups)) == {"WORLD", str(f["expert_group"])}, groups  # the model's, the experts'
    for step in range(ep_scenarios.STEPS):  # the same FP8 state where the experts are the same, not elsewhere
        states = [f["amax_states"][step] for f in facts]
        assert states[0] == states[2] and states[1] == states[3]
        assert all(states[0][k] != states[1][k] for k in states[0])


def test_an_ep_rank_without_tokens_still_runs_every_collective(launched):
    """Every token routed to experts 0 and 1 (EP rank 0): EP rank 1's experts get none — transformers hands them one
    zero row to keep backward connected, padded to 16 — and the ranks' collectives still agree (the pool's audit)."""
    facts = _facts(launched, PLAN[2][1])
    for rank, f in enumerate(facts):
        if rank % 2:
            assert f["rows_per_step"] == [16] * ep_scenarios.STEPS
        else:
            assert min(f["rows_per_step"]) > 16


def test_save_state_and_load_state_keep_every_ep_ranks_expert_fp8_state(launched):
    """The experts runners' FP8 state differs per EP rank (each holds its own experts'); a plain ``_extra_state``
    reaches DCP as a replicated value written by one rank, so every EP rank loaded that rank's experts' scales.
    Inside save_state / load_state it is handed to DCP sharded on ``ep`` by expert: a differently initialised EP
    model loads every local parameter shard and every piece of FP8 state bit for bit, and resumes exactly."""
    (key,) = [k for k in launched[0] if k.startswith("sc_ep_checkpoint")]
    facts = scenarios.facts_of(launched, key)
    for f in facts:
        assert f["params_unequal"] == [] and f["fp8_unequal"] == [], (f["params_unequal"], f["fp8_unequal"])
        assert f["expert_fp8_keys"] == 16 and f["fp8_compared"] == 48  # 2 layers x 2 runners x fwd/bwd x 2 tensors
        assert f["loss_resumed"] == f["loss_after"]
    assert facts[0]["expert_fp8_sum"] == facts[2]["expert_fp8_sum"] != facts[1]["expert_fp8_sum"]


def test_the_export_of_an_ep_model_loads_in_plain_transformers(launched):
    """``save_model`` of the EP model in FP8 (full tensors, no FP8 state) next to the family's config: plain
    transformers loads it in this process with no missing or unexpected key, every parameter equal to the trained
    model's full tensor."""
    import torch
    import transformers

    (key,) = [k for k in launched[0] if k.startswith("sc_ep_checkpoint")]
    export = scenarios.facts_of(launched, key)[0]["export"]
    training.zoo_model("qwen3_moe").config.save_pretrained(export)  # save_model writes the weights only
    model, info = transformers.AutoModelForCausalLM.from_pretrained(export, output_loading_info=True)
    want = torch.load(f"{export}_reference.pt")
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert sorted(n for n, _ in model.named_parameters()) == sorted(want)
    assert [n for n, p in model.named_parameters() if not torch.equal(p, want[n])] == []


def test_a_checkpoint_loads_across_ep_sizes_and_back_bit_for_bit(launched):
    """EP 2 saves; the same model without EP (experts FSDP2-sharded, each runner holding all 4 experts) loads every
    weight and every expert's FP8 state — its runner's columns are EP rank 0's experts', then EP rank 1's — and
    saves; EP 2 loads that back: each EP rank's experts' state bit for bit what it saved."""
    (key,) = [k for k in launched[0] if k.startswith("sc_ep_resize")]
    for f in scenarios.facts_of(launched, key):
        assert not f["no_ep_experts_parallel"]
        assert (f["ep_runner_shape"], f["no_ep_runner_shape"]) == ([16, 6], [16, 12])  # 3 forward tensors / GEMM
        assert f["no_ep_fp8_unequal"] == [] and f["no_ep_params_unequal"] == []
        assert f["back_fp8_unequal"] == [] and f["back_params_unequal"] == []


@pytest.fixture(scope="module")
def two_ranks():
    return scenarios.launch(ep_scenarios, TWO_RANK_PLAN, 2)


TWO_RANK_PLAN = [("sc_ep", {"fsdp": 2, "ep": 2})]


def test_two_ranks_each_holding_whole_experts(two_ranks):
    """fsdp 2 x ep 2 on 2 ranks: efsdp is 1, every expert lives whole on one rank — its FP8 state is reduced over
    no other rank (a one-rank group: TE skips the reduction), still bit for bit the reference's for its experts,
    and the run trains like one process."""
    for rank, f in enumerate(scenarios.facts_of(two_ranks, scenarios.key_of(TWO_RANK_PLAN, "sc_ep"))):
        assert f["experts"] == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
        assert f["expert_group"] == [rank] and f["ep_rank"] == rank
        assert set(map(str, f["stats"]["amax_reduction_groups"])) == {"WORLD"}
        assert all(f["amax_step0_equal_reference"].values()) and not any(f["amax_step0_equal_other_experts"].values())
        assert f["losses"][0] == pytest.approx(f["reference"][0], rel=2e-4)
        assert f["losses"] == pytest.approx(f["reference"], rel=1e-2)
        assert f["grad_norms"] == pytest.approx(f["reference_grad_norms"], rel=3e-2)


@pytest.mark.parametrize("kw", [kw for _, kw in EP_TP], ids=["ep2", "ep4"])
def test_ep_with_tp_trains_its_experts_in_fp8_like_the_one_process_reference(launched, kw):
    """EP x TP as transformers sets it up (``ep_size`` a multiple of ``tp_size``): attention TP-sharded and on TE,
    each rank's whole experts on TE grouped GEMMs in FP8; each expert's scales shared with the ranks holding it (the
    experts' mesh without 'ep': efsdp) and no other expert's; losses and clipped norms against one process."""
    facts = scenarios.facts_of(launched, scenarios.key_of(_plan4(None), "sc_ep", kw))
    local = 4 // kw["ep"]
    for rank, f in enumerate(facts):
        assert f["experts"] == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"], f["skipped"]
        assert not any("experts" in n for n in f["skipped"]), f["skipped"]
        assert f["tp_linears"] == {"q_proj": "column", "k_proj": "column", "v_proj": "column", "o_proj": "row"}
        assert f["local_experts"] == local and "AllToAllEP" in f["ep_implementations"]
        assert f["stats"]["non_fp8_gemms"] == 0 and f["stats"]["grouped_gemms"] == 12 * len(f["losses"])
        assert f["fp8_share_outside_lm_head"] >= 0.9, f["high_precision"]
        assert f["losses"][0] == pytest.approx(f["reference"][0], rel=2e-4)
        assert f["losses"] == pytest.approx(f["reference"], rel=1e-2)
        assert f["grad_norms"] == pytest.approx(f["reference_grad_norms"], rel=3e-2)
        # this rank's experts' amax histories are the reference's columns of ITS experts, no other rank's
        assert all(f["amax_step0_equal_reference"].values()), f["amax_step0_equal_reference"]
        assert not any(f["amax_step0_equal_any_other_expert"].values())
    holders = {}
    for rank, f in enumerate(facts):
        holders.setdefault(f["ep_rank"], []).append(rank)
    for f in facts:  # the experts' group: exactly the ranks holding the same experts
        assert f["expert_group"] == holders[f["ep_rank"]]
    # evaluation (FP8 off in eval; AutoEP's all-reduce dispatch where ep == tp): the ranks sharing a batch agree
    by_batch = {}
    for f in facts:
        by_batch.setdefault(f["dp_rank"], set()).add(round(f["eval_loss"], 5))
    assert all(len(v) == 1 for v in by_batch.values()), by_batch
    assert all(abs(f["eval_loss"] - f["losses"][-1]) < 0.2 for f in facts)
