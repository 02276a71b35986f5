"""The Megatron strategy's pipeline plumbing without Megatron-Core, on two gloo ranks in seconds (the CI
sibling of ``test_megatron_pipeline.py``): ``Pipeline``'s stage-to-stage autograd functions on a toy
two-stage model, and ``SplitRouted``'s router loss split over stages or over a row's columns (the CI sibling of ``test_megatron_sequence_parallel.py``), each against one process computing
the unsplit thing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.integration.megatron_cpu import run_ranks

ROWS, T, H, V = 4, 5, 8, 11  # the group's rows (2 a rank), tokens, width, vocabulary
SPANS = [(0, 2), (2, 2)]  # each stage's rank's rows among the group's


def _toy() -> tuple[torch.Tensor, torch.nn.Linear, torch.nn.Linear, torch.nn.Linear, torch.Tensor]:
    """The group's input ``(ROWS, T, H)``, stage 0's layer, stage 1's layer and head, and each row's
    weights of the logits in the loss: the same in every process."""
    torch.manual_seed(0)
    x = torch.randn(ROWS, T, H)
    first, second, head = torch.nn.Linear(H, H), torch.nn.Linear(H, H), torch.nn.Linear(H, V)
    return x, first, second, head, torch.randn(ROWS, T, V)


def _pipe():
    from reroll.strategies.megatron_pipeline import Pipeline

    return Pipeline(stage=dist.get_rank(), ranks=(0, 1), group=dist.group.WORLD, tp_group=None)


def _stage_forward(pipe, x, first, second, head) -> torch.Tensor:
    """This rank's rows' logits through its stage: stage 0's layer, or stage 1's layer and head."""
    if pipe.first:
        out = torch.tanh(first(x))
    else:
        out = head(torch.tanh(second(pipe.receive((ROWS, T, H), torch.float32, torch.device("cpu")))))
    return pipe.output(out, SPANS, (T, V), torch.float32)


def _stage_rank(rank: int, world_size: int, address: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://{address}", rank=rank, world_size=world_size)
    x, first, second, head, c = _toy()
    pipe = _pipe()
    mine = _stage_forward(pipe, x, first, second, head)
    start, n = SPANS[rank]
    loss = (mine * c[start : start + n]).sum()
    loss.backward()
    modules = {"first": first, "second": second, "head": head}
    grads = {f"{m}.{n}": p.grad for m, module in modules.items() for n, p in module.named_parameters()}
    with torch.no_grad():  # a forward-only pass: no graph, the same logits
        again = _stage_forward(pipe, x, first, second, head)
    saved = {"logits": mine.detach(), "again": again, "loss": float(loss.detach()), "grads": grads}
    torch.save(saved, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


def test_two_stages_give_each_rank_its_logits_and_the_unsplit_gradients(tmp_path: Path):
    """Stage 0 runs its layer on the group's rows and sends them on; stage 1 runs the rest and hands
    rank 0 its rows' logits; each rank's loss of its own rows backpropagates through both stages. The
    logits equal one process's on the whole model exactly (the same operations on the same tensors),
    the losses and every weight's gradient to fp32 summation order (each rank's rows' logit gradients
    land in disjoint rows; a weight's sum over the rows is split where the loss is)."""
    ranks = run_ranks(_stage_rank, 2, tmp_path)
    x, first, second, head, c = _toy()
    logits = head(torch.tanh(second(torch.tanh(first(x)))))
    (logits * c).sum().backward()
    for rank, (start, n) in enumerate(SPANS):
        assert torch.equal(ranks[rank]["logits"], logits[start : start + n].detach())
        assert torch.equal(ranks[rank]["again"], ranks[rank]["logits"])
    total = float((logits * c).sum().detach())
    assert abs(ranks[0]["loss"] + ranks[1]["loss"] - total) <= 1e-6 * abs(total)  # two partial sums
    owned = {0: ("first",), 1: ("second", "head")}  # the weights each stage trains
    for rank, names in owned.items():
        for name, module in zip(("first", "second", "head"), (first, second, head)):
            for pn, p in module.named_parameters():
                got = ranks[rank]["grads"][f"{name}.{pn}"]
                if name in names:
                    torch.testing.assert_close(got, p.grad, atol=1e-6, rtol=0)  # two partial sums
                else:
                    assert got is None, (rank, name)


def _chunked_rank(rank: int, world_size: int, address: str, out: str) -> None:
    """Two chunks a stage, unscheduled (``Pipeline.pass_on``): stage 0 holds layers 0 and 2, stage 1
    layers 1 and 3 and the head; the rows cross the stages twice (0 -> 1 -> 0 -> 1)."""
    dist.init_process_group("gloo", init_method=f"tcp://{address}", rank=rank, world_size=world_size)
    x, layers, head, c = _chunked_toy()
    pipe = _pipe()
    shape, cpu = (ROWS, T, H), torch.device("cpu")
    h = x if pipe.first else pipe.receive(shape, torch.float32, cpu)
    h = torch.tanh(layers[rank](h))  # chunk 0
    h = pipe.pass_on(h, shape, torch.float32)  # round the ring: stage 1's chunk 0 -> stage 0's chunk 1
    h = torch.tanh(layers[rank + 2](h))  # chunk 1
    mine = pipe.output(head(h) if pipe.last else h, SPANS, (T, V), torch.float32)
    start, n = SPANS[rank]
    (mine * c[start : start + n]).sum().backward()
    grads = {f"{i}.{n}": p.grad for i, layer in enumerate(layers) for n, p in layer.named_parameters()}
    saved = {"logits": mine.detach(), "grads": grads, "head": head.weight.grad}
    torch.save(saved, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


def _chunked_toy() -> tuple[torch.Tensor, list[torch.nn.Linear], torch.nn.Linear, torch.Tensor]:
    torch.manual_seed(0)
    x = torch.randn(ROWS, T, H)
    return x, [torch.nn.Linear(H, H) for _ in range(4)], torch.nn.Linear(H, V), torch.randn(ROWS, T, V)


def test_two_chunks_a_stage_pass_the_rows_round_the_ring_and_the_gradients_back(tmp_path: Path):
    """``Pipeline.pass_on`` (a virtual pipeline outside the schedule: ``logits`` calls, context
    parallelism): each stage's non-final chunk sends its output on (the last stage's to the first) and
    receives its next chunk's input, and backward brings each gradient back the same way. The logits
    equal one process's exactly (the same operations on the same tensors); the weights' gradients to
    fp32 summation order (each rank's loss is its own rows'; measured: equal, with the kernels at
    default, AVX2 and AVX-512 alike, as the last stage returns the whole logits' gradient at once), and
    each stage has gradients only for the layers it holds."""
    ranks = run_ranks(_chunked_rank, 2, tmp_path)
    x, layers, head, c = _chunked_toy()
    h = x
    for layer in layers:
        h = torch.tanh(layer(h))
    logits = head(h)
    (logits * c).sum().backward()
    for rank, (start, n) in enumerate(SPANS):
        assert torch.equal(ranks[rank]["logits"], logits[start : start + n].detach())
        for i, layer in enumerate(layers):
            for pn, p in layer.named_parameters():
                got = ranks[rank]["grads"][f"{i}.{pn}"]
                if i % 2 == rank:  # stage 0: layers 0 and 2; stage 1: layers 1 and 3
                    torch.testing.assert_close(got, p.grad, atol=1e-6, rtol=0)
                else:
                    assert got is None, (rank, i)
    torch.testing.assert_close(ranks[1]["head"], head.weight.grad, atol=1e-6, rtol=0)


LAYERS, TOKENS, EXPERTS, TOP_K = 4, 6, 4, 2  # the router logits of a 4-layer MoE, 2 layers a stage
SHARES = (0.25, 0.75)


def _router_logits() -> tuple[torch.Tensor, torch.Tensor]:
    """Every layer's ``(L, N, E)`` logits of the group's tokens (``[s, b]`` order: token ``j`` is row
    ``j % ROWS``) and which are real."""
    torch.manual_seed(1)
    logits = torch.randn(LAYERS, TOKENS * ROWS, EXPERTS)
    real = torch.rand(TOKENS * ROWS) > 0.2
    return logits, real


def _router_rank(rank: int, world_size: int, address: str, out: str) -> None:
    from reroll.strategies.megatron_moe import RowSplit, SplitRouted

    dist.init_process_group("gloo", init_method=f"tcp://{address}", rank=rank, world_size=world_size)
    logits, real = _router_logits()
    mine = logits[2 * rank : 2 * rank + 2].clone().requires_grad_()
    pipe = _pipe()
    routed = SplitRouted(split=RowSplit(pipe.group, pipe.stage, pipe=pipe), num_layers=LAYERS)
    routed.logits.append(list(mine))
    routed.real.append(real)
    routed.spans.append((ROWS, SPANS))
    weighted, aux, counts = routed.term(TOP_K, SHARES[rank])
    weighted.backward()
    saved = {"weighted": float(weighted), "aux": float(aux), "counts": counts, "grad": mine.grad}
    torch.save(saved, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


def test_the_router_loss_on_stages_is_each_ranks_own_over_every_layer(tmp_path: Path):
    """Each stage holds 2 of the 4 layers' router logits of both ranks' rows. Each rank reports the load-
    balancing loss and the (L, E) load of its own rows over all 4 layers, and the stages' backpropagated
    parts add up to the share-weighted sum of the ranks' losses, with its gradient (against ``Routed``,
    what a rank computes without stages; fp32 sums in another order: 1e-6)."""
    from reroll.models.moe import Routed

    ranks = run_ranks(_router_rank, 2, tmp_path)
    logits, real = _router_logits()
    logits.requires_grad_()
    rows = torch.arange(TOKENS * ROWS) % ROWS
    total = 0.0
    for rank, (start, n) in enumerate(SPANS):
        own = real & (rows >= start) & (rows < start + n)
        aux, counts = Routed(logits=[list(logits)], real=[own]).loss(TOP_K)
        torch.testing.assert_close(ranks[rank]["aux"], float(aux.detach()), atol=1e-6, rtol=0)
        assert torch.equal(ranks[rank]["counts"], counts)
        total = total + SHARES[rank] * aux
    total.backward()
    assert abs(ranks[0]["weighted"] + ranks[1]["weighted"] - float(total)) < 1e-6
    for rank in range(2):
        torch.testing.assert_close(
            ranks[rank]["grad"], logits.grad[2 * rank : 2 * rank + 2], atol=1e-7, rtol=0
        )


def _column_rank(rank: int, world_size: int, address: str, out: str, same_rows: bool) -> None:
    """This rank's half of the columns (tokens ``[s, b]``: the first or last ``TOKENS / 2`` positions of
    every row) of every layer's router logits, routed as under sequence parallelism (members: the two
    ranks, each its own rows, ``SPANS``) or context parallelism (``same_rows``: one member, every row)."""
    from reroll.strategies.megatron_moe import RowSplit, SplitRouted

    dist.init_process_group("gloo", init_method=f"tcp://{address}", rank=rank, world_size=world_size)
    logits, real = _router_logits()
    half = slice(rank * TOKENS // 2 * ROWS, (rank + 1) * TOKENS // 2 * ROWS)
    mine = logits[:, half].clone().requires_grad_()
    members = None if same_rows else dist.group.WORLD
    split = RowSplit(members, 0 if same_rows else rank, columns=dist.group.WORLD)
    routed = SplitRouted(split=split, num_layers=LAYERS)
    routed.logits.append(list(mine))
    routed.real.append(real[half])
    routed.spans.append((ROWS, [(0, ROWS)] if same_rows else SPANS))
    share = SHARES[0] if same_rows else SHARES[rank]
    weighted, aux, counts = routed.term(TOP_K, share)
    weighted.backward()
    saved = {"weighted": float(weighted), "aux": float(aux), "counts": counts, "grad": mine.grad}
    torch.save(saved, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.parametrize("same_rows", [False, True], ids=["sequence-parallel", "context-parallel"])
def test_the_router_loss_on_split_columns_is_each_members_own_over_every_column(tmp_path: Path, same_rows):
    """Each rank holds half of every row's tokens through all 4 layers. Under sequence parallelism (two
    members, each its own rows) each rank reports the loss and (L, E) load of its own rows over every
    column; under context parallelism (one member: both ranks run the same rows) both report the rows'.
    The ranks' backpropagated parts add up to the share-weighted sum of the members' losses, with its
    gradient (against ``Routed`` on the whole tokens; fp32 sums in another order: 1e-6)."""
    from reroll.models.moe import Routed

    ranks = run_ranks(_column_rank, 2, tmp_path, same_rows)
    logits, real = _router_logits()
    logits.requires_grad_()
    rows = torch.arange(TOKENS * ROWS) % ROWS
    spans = [(0, ROWS)] if same_rows else SPANS
    total = 0.0
    for member, (start, n) in enumerate(spans):
        own = real & (rows >= start) & (rows < start + n)
        aux, counts = Routed(logits=[list(logits)], real=[own]).loss(TOP_K)
        for rank in (0, 1) if same_rows else (member,):
            torch.testing.assert_close(ranks[rank]["aux"], float(aux.detach()), atol=1e-6, rtol=0)
            assert torch.equal(ranks[rank]["counts"], counts)
        total = total + SHARES[member] * aux
    total.backward()
    assert abs(ranks[0]["weighted"] + ranks[1]["weighted"] - float(total)) < 1e-6
    for rank in range(2):
        half = slice(rank * TOKENS // 2 * ROWS, (rank + 1) * TOKENS // 2 * ROWS)
        torch.testing.assert_close(ranks[rank]["grad"], logits.grad[:, half], atol=1e-7, rtol=0)


def _chunked_hf():
    """A 4-layer tied Qwen2 (q/k/v biases) with weights away from their init: the same in every process."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=37, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(config).float()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.1)
    return config, model.state_dict()


def _chunks_rank(rank: int, world_size: int, address: str, out: str) -> None:
    from reroll.models import megatron_convert as mc
    from reroll.strategies.megatron_weights import Groups, hf_weights

    dist.init_process_group("gloo", init_method=f"tcp://{address}", rank=rank, world_size=world_size)
    config, hf = _chunked_hf()
    s = mc.gpt_shape(config)
    chunks = [mc.rank_from_hf(hf, s, stage=rank, pp=2, chunk=c, vp=2) for c in range(2)]
    groups = Groups(1, None, 1, None, _pipe(), torch.device("cpu"), vp=2)
    torch.save(list(hf_weights(chunks, s, groups, on_device=False)), f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


def test_hf_weights_gather_every_model_chunk_of_a_virtual_pipeline(tmp_path: Path):
    """PP=2 x VPP=2 on 4 layers (stage 0 holds layers 0 and 2, stage 1 layers 1 and 3, each chunk's
    numbered from 0): weight sync and export's ``hf_weights`` give both ranks every Hugging Face weight,
    in the model's order, bit-equal to the model they were read from (a split and a broadcast: no
    arithmetic)."""
    _, hf = _chunked_hf()
    for got in run_ranks(_chunks_rank, 2, tmp_path):
        names = [name for name, _ in got]
        assert sorted(names) == sorted(hf)  # each once, the tied head included
        layers = [int(n.split(".")[2]) for n in names if n.startswith("model.layers.")]
        assert layers == sorted(layers)  # layer by layer, 0 to 3, whichever chunk holds it
        assert names[0] == "model.embed_tokens.weight" and names[-1] == "lm_head.weight"
        for name, w in got:
            assert torch.equal(w, hf[name]), name
