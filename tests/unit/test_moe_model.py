"""The tiny mixture-of-experts model (model.build_tiny.moe) and its routers watched in a forward
(reroll.models.moe)."""

import pytest
import torch
from pydantic import ValidationError
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3MoeForCausalLM

from reroll.config.model import TinyModelConfig, TinyMoEConfig
from reroll.data.arithmetic import ARITHMETIC_ALPHABET
from reroll.models.moe import Routers, StepRouting
from reroll.models.tiny import build_tiny_model, char_tokenizer


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    moe = TinyMoEConfig(experts=4, top_k=2)
    path = tmp_path_factory.mktemp("moe")
    return build_tiny_model(path, alphabet=ARITHMETIC_ALPHABET, hidden_size=64, num_heads=2, moe=moe)


def test_tiny_moe_is_a_qwen3_moe_that_reloads(moe_dir):
    model = AutoModelForCausalLM.from_pretrained(moe_dir)
    assert isinstance(model, Qwen3MoeForCausalLM)
    c = model.config
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size) == (4, 2, 128)
    assert c.head_dim == 32 and c.norm_topk_prob and not c.output_router_logits
    assert c.router_aux_loss_coef == 0.001 and c.mlp_only_layers == []
    # every layer's experts as one tensor each in memory (transformers 5), one per expert on disk
    assert model.model.layers[1].mlp.experts.gate_up_proj.shape == (4, 256, 64)
    tok, reloaded = char_tokenizer(ARITHMETIC_ALPHABET), AutoTokenizer.from_pretrained(moe_dir)
    assert reloaded("12+34=")["input_ids"] == tok("12+34=")["input_ids"]
    # rebuilt with the same seed: the same weights
    again = build_tiny_model(
        moe_dir.parent / "again",
        alphabet=ARITHMETIC_ALPHABET,
        hidden_size=64,
        num_heads=2,
        moe=TinyMoEConfig(),
    )
    other = AutoModelForCausalLM.from_pretrained(again)
    for (name, a), (_, b) in zip(model.state_dict().items(), other.state_dict().items()):
        assert torch.equal(a, b), name


def test_moe_section_is_range_checked():
    with pytest.raises(ValidationError, match=r"top_k \(5\) must be at most experts \(4\)"):
        TinyModelConfig(moe={"experts": 4, "top_k": 5})
    with pytest.raises(ValidationError, match="multiple of 32"):
        TinyMoEConfig(expert_hidden_size=48)
    with pytest.raises(ValidationError, match="greater than or equal to 2"):
        TinyMoEConfig(experts=1)
    with pytest.raises(ValidationError, match="Extra inputs"):
        TinyModelConfig(moe={"experts": 4, "topk": 2})


def test_aux_coef_in_the_section_turns_the_models_own_loss_on(tmp_path):
    moe = TinyMoEConfig(router_aux_loss_coef=0.02)
    path = build_tiny_model(tmp_path, alphabet="0123456789", hidden_size=64, num_heads=2, moe=moe)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.config.output_router_logits and model.config.router_aux_loss_coef == 0.02
    routers = Routers.of(model)
    assert routers is not None and routers.coef(None) == 0.02 and routers.coef(0.0) == 0.0


def test_a_dense_model_has_no_routers(assets):
    assert Routers.of(AutoModelForCausalLM.from_pretrained(assets["model"])) is None


def test_captured_loss_equals_transformers_aux_loss_on_padded_rows(moe_dir):
    """The routers' logits caught by hooks give the aux loss transformers computes itself (with
    output_router_logits), padding left out; its gradient reaches every router, and nothing after the
    last router (the last layer's experts, the final norm)."""
    model = AutoModelForCausalLM.from_pretrained(moe_dir)
    routers = Routers.of(model)
    assert routers is not None and len(routers.modules) == 2 and routers.model_coef == 0.0
    torch.manual_seed(0)
    ids = torch.randint(6, 20, (3, 7))
    mask = torch.ones_like(ids)
    mask[0, 4:] = 0
    mask[2, 2:] = 0
    with routers.capture() as routed:
        out = model(input_ids=ids, attention_mask=mask, output_router_logits=True)
    assert len(routed.logits) == 1 and len(routed.logits[0]) == 2  # one forward, two MoE layers
    ours, counts = routed.loss(routers.top_k)
    torch.testing.assert_close(ours, out.aux_loss)
    assert counts.sum() == 2 * int(mask.sum()) * 2  # layers x real tokens x top_k
    model.zero_grad()
    ours.backward()
    touched = {n for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert {n for n in touched if "mlp.gate." in n} == {f"model.layers.{i}.mlp.gate.weight" for i in (0, 1)}
    assert not any(n.startswith(("model.layers.1.mlp.experts", "model.norm")) for n in touched)


def test_gradient_checkpointing_keeps_the_routers_gradient(moe_dir):
    """With activations recomputed in backward (non-reentrant checkpointing, as the strategies enable it),
    the aux loss's gradient on the routers is the same as without."""
    ids = torch.randint(6, 20, (2, 6), generator=torch.Generator().manual_seed(1))
    grads = []
    for checkpointing in (False, True):
        model = AutoModelForCausalLM.from_pretrained(moe_dir)
        model.train()
        if checkpointing:
            model.gradient_checkpointing_enable()
        routers = Routers.of(model)
        with routers.capture() as routed:
            model(input_ids=ids)
        routed.loss(routers.top_k)[0].backward()
        grads.append(model.model.layers[0].mlp.gate.weight.grad.clone())
    torch.testing.assert_close(grads[1], grads[0])
    assert grads[0].abs().sum() > 0


def test_step_routing_weights_micro_batches_by_share(moe_dir):
    """Two micro-batches of shares 1/4 and 3/4: the term joining each loss is coef x share x its aux
    loss; the logged aux loss is their share-weighted mean; the load is counted over both."""
    model = AutoModelForCausalLM.from_pretrained(moe_dir)
    routers = Routers.of(model)
    step, alone = StepRouting(routers, coef=0.5), []
    for share, seed in ((0.25, 0), (0.75, 1)):
        ids = torch.randint(6, 20, (2, 5), generator=torch.Generator().manual_seed(seed))
        with routers.capture() as routed:
            model(input_ids=ids)
        aux, _ = routed.loss(routers.top_k)
        alone.append(float(aux.detach()))
        torch.testing.assert_close(step.term(routed, share), 0.5 * share * aux)
    m = step.metrics("actor")
    assert m["actor/router_aux_loss"] == pytest.approx(0.25 * alone[0] + 0.75 * alone[1], rel=1e-6)
    assert m["actor/router_aux_coef"] == 0.5
    # 2 layers of 4 experts, 2 x 10 tokens, top 2: the extremes bound an even load (half the tokens each)
    assert m["actor/expert_load_min"] <= 0.5 <= m["actor/expert_load_max"] <= 1
    assert 0 < m["actor/expert_load_entropy"] <= 1
    assert StepRouting(routers, coef=0.0).metrics("actor") == {}  # no micro-batch: nothing to say


def test_a_split_row_is_refused_only_for_routers_that_see_whole_rows(moe_dir):
    """Under context parallelism a rank's routers see part of each row: the trainer refuses transformers'
    routers (their loss is built for whole rows) and takes routers that pool a row over its ranks
    (``sees_split_rows``: Megatron's ``SplitRouted``)."""
    import types

    from reroll.errors import UserError
    from reroll.roles.trainer import TrainerWorker

    routers = Routers.of(AutoModelForCausalLM.from_pretrained(moe_dir))
    assert routers is not None and not getattr(routers, "sees_split_rows", False)
    cfg = types.SimpleNamespace(model=types.SimpleNamespace(router_aux_loss_coef=0.1))
    split = types.SimpleNamespace(size=2)
    worker = types.SimpleNamespace(routers=routers, context_parallel=split, cfg=cfg)
    with pytest.raises(UserError, match=r"strategy\.context_parallel=2 with a mixture-of-experts model"):
        TrainerWorker._routing(worker)
    pooled = types.SimpleNamespace(sees_split_rows=True, coef=lambda setting: setting, top_k=2)
    routing = TrainerWorker._routing(types.SimpleNamespace(routers=pooled, context_parallel=split, cfg=cfg))
    assert isinstance(routing, StepRouting) and routing.coef == 0.1
