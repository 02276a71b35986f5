"""DPO on image pairs, through the pipeline (``run`` with runtime.backend local: the real roles, in this
process): the tiny Qwen2.5-VL model counts the squares in an image, the right count preferred to a wrong
one. What the DPO objective sees for a pair's rows, the policy's log-probs and the reference's, equals
a direct forward of the model on that row with its own image (Hugging Face's image processor and the
model's own 3D positions); ten steps open a chosen-over-rejected margin on the training pairs (measured
on the 2-core dev machine: mean margin 0 -> 1.14, pairwise accuracy 0 -> 1.0; the bars are 0.3 and 0.5).
About 13 s there, 2.5 s of it the run.

Tolerance: both sides run the same fp32 model on the same tokens and pixels; the pipeline's forward is
a right-padded batch of 16 rows, the direct one a single unpadded row, so they differ in summation order
alone. A sequence log-prob here sums 2 token log-probs (the count and eos), each a log-softmax of logits
that ~10 fp32 reductions over 32-128 terms produced, rounding at float32's eps (1.2e-7) relative to
values of order 1-10: differences of order 1e-6. ATOL = 1e-5 holds that with a margin (as
test_vision.py's engine-against-trainer check); the same row scored with the next pair's image moves by
~0.07, and with 1D positions (the model's fallback without the image-token mask) by ~9e-4: the test
checks that it would catch either.
"""

from __future__ import annotations

import base64
import io
import json
import re
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from reroll.config.loader import load_config
from reroll.config.schema import RunConfig
from reroll.data.shapes import SHAPES_ALPHABET, make_shapes_rows
from reroll.models.loading import load_tokenizer
from reroll.models.tiny_vision import build_tiny_vl_model
from reroll.roles.objectives import DirectPreference
from reroll.runtime.metrics import read_metrics

pytestmark = pytest.mark.integration

ATOL = 1e-5
PAIRS = 8
SEEN: list[dict[str, Any]] = []  # what the objective saw, micro-batch by micro-batch


@dataclass
class _Watched:
    """The trainer rank an objective runs on, with the pair scores it hands the objective recorded."""

    policy: Any

    def __getattr__(self, name: str) -> Any:
        return getattr(self.policy, name)

    def pair_scores(self, mb: Any, **kw: Any) -> Any:
        scores, rows, logprobs = self.policy.pair_scores(mb, **kw)
        ref = [None if t is None else t.detach().clone() for t in (mb.ref_chosen, mb.ref_rejected)]
        SEEN.append({"scores": scores.detach().clone(), "rows": rows, "ref": ref})
        return scores, rows, logprobs


@dataclass(frozen=True)
class Recording(DirectPreference):
    """DPO's objective, recording the log-probs each micro-batch's loss reads."""

    def pair_loss(self, policy: Any, mb: Any) -> Any:
        return super().pair_loss(_Watched(policy), mb)


@pytest.fixture(scope="module")
def vl_pairs(tmp_path_factory):
    """The tiny VL model, the shapes rows, and pairs over them: the right count against a wrong one."""
    root = tmp_path_factory.mktemp("vl_dpo")
    model = build_tiny_vl_model(root / "model", alphabet=SHAPES_ALPHABET)
    rows = make_shapes_rows(PAIRS, seed=5)
    (root / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    pairs = [
        {
            "id": r["id"],
            "prompt": r["question"],
            "chosen": r["answer"],
            "rejected": str(int(r["answer"]) % 4 + 1),
        }
        | {"images": r["images"]}
        for r in rows
    ]
    (root / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    return root, model, pairs


def _config(root, model, steps: int) -> RunConfig:
    cfg = {
        "pipeline": "dpo",
        "name": "vl-dpo",
        "output_dir": str(root / "runs" / "{name}"),
        "total_steps": steps,
        "model": {"path": str(model), "train_vision": True},
        "data": {"train_files": [str(root / "rows.jsonl")], "prompt_template": "{question}"},
        "preference": {
            "train_files": [str(root / "pairs.jsonl")],
            "eval_files": [str(root / "pairs.jsonl")],  # the training pairs' margins
            "batch_size": PAIRS,
            "shuffle": False,  # step 1's batch: the pairs in file order
        },
        "dpo": {"beta": 0.5},
        "optim": {"lr": 1e-3, "micro_batch_size": PAIRS, "warmup_steps": 0},
        "eval": {"every": steps},
        "checkpoint": {"every": 0},
        "runtime": {"backend": "local"},
        "roles": {r: {"torch_threads": 1} for r in ("actor_train", "reference")},
        "logging": {"tensorboard": False},
    }
    (root / "dpo.yaml").write_text(json.dumps(cfg))
    return load_config(root / "dpo.yaml", RunConfig)


def _direct_logprob(
    model: Any,
    processor: Any,
    ids: torch.Tensor,
    response: torch.Tensor,
    image: bytes,
    *,
    rope_3d: bool = True,
) -> float:
    """The summed log-prob of one unpadded row's response tokens, the model run on the row with ``image``:
    its pixels from the image processor, its 3D positions computed by the model from the image-token
    mask a Qwen2.5-VL processor returns (``mm_token_type_ids``; without it, ``rope_3d=False``, the model
    falls back to 1D positions)."""
    from PIL import Image

    pixels = processor(images=[Image.open(io.BytesIO(image)).convert("RGB")], return_tensors="pt")
    mask = {"mm_token_type_ids": (ids == model.config.image_token_id).int()[None]} if rope_3d else {}
    with torch.no_grad():
        logits = model(
            input_ids=ids[None],
            pixel_values=pixels["pixel_values"],
            image_grid_thw=pixels["image_grid_thw"],
            **mask,
        ).logits[0]
    token = torch.log_softmax(logits[:-1].float(), -1).gather(-1, ids[1:, None])[:, 0]
    return float(token[response[1:]].sum())


def test_dpo_on_image_pairs_scores_each_row_with_its_image_and_opens_the_margin(vl_pairs, monkeypatch):
    from transformers import AutoImageProcessor, AutoModelForImageTextToText

    from reroll.pipelines import dpo
    from reroll.pipelines.run import run

    root, model_dir, pairs = vl_pairs
    SEEN.clear()
    monkeypatch.setattr(dpo, "DirectPreference", Recording)
    steps = 10
    run(dpo.DPO, _config(root, model_dir, steps))

    # step 1: the policy is the reference, and what the objective saw is a direct forward of each row
    assert len(SEEN) == steps, "the recording objective ran once per step (one micro-batch)"
    step1 = SEEN[0]
    rows, scores = step1["rows"], step1["scores"]
    assert len(rows) == 2 * PAIRS and rows.pixel_values is not None
    model = AutoModelForImageTextToText.from_pretrained(model_dir).eval()
    processor = AutoImageProcessor.from_pretrained(model_dir)
    tokenizer = load_tokenizer(str(model_dir))
    direct, moved, flat_moved = [], [], []
    for r in range(2 * PAIRS):
        pair = pairs[r % PAIRS]
        ids = rows.input_ids[r][rows.attention_mask[r]]
        response = rows.response_mask[r][rows.attention_mask[r]]
        answer = pair["chosen"] if r < PAIRS else pair["rejected"]
        want = f"<|user|><|vision_start|><image x16><|vision_end|>{pair['prompt']}<|assistant|>{answer}"
        assert _text(tokenizer, ids) == want + tokenizer.eos_token, r  # 32x32: 16 image tokens
        image = base64.b64decode(pair["images"][0])
        direct.append(_direct_logprob(model, processor, ids, response, image))
        other = base64.b64decode(pairs[(r + 1) % PAIRS]["images"][0])  # the next pair's image
        moved.append(abs(_direct_logprob(model, processor, ids, response, other) - direct[-1]))
        flat = _direct_logprob(model, processor, ids, response, image, rope_3d=False)
        flat_moved.append(abs(flat - direct[-1]))
    direct_t = torch.tensor(direct)
    torch.testing.assert_close(scores, direct_t, atol=ATOL, rtol=0)
    ref_chosen, ref_rejected = step1["ref"]
    torch.testing.assert_close(torch.cat([ref_chosen, ref_rejected]), direct_t, atol=ATOL, rtol=0)
    assert max(moved) > 20 * ATOL, moved  # the image matters: another image's would not pass
    assert max(flat_moved) > 20 * ATOL, flat_moved  # and the 3D positions: 1D ones would not pass

    # a few steps open the margin on the training pairs
    metrics = {r["step"]: r for r in read_metrics(root / "runs" / "vl-dpo")}
    assert metrics[1]["dpo/loss"] == pytest.approx(0.693147, abs=1e-5)  # -log sigmoid(0)
    before, after = metrics[0], metrics[steps]
    assert before["eval/margins"] == pytest.approx(0.0, abs=1e-6)
    assert after["eval/margins"] > 0.3, after  # measured 1.14 (0 -> 1.14 in 10 steps)
    assert after["eval/pair_accuracy"] > 0.5, after  # measured 1.0 (8 of 8); 0 at the start (ties)


def _text(tokenizer: Any, ids: torch.Tensor) -> str:
    """A row's tokens as text, its run of image tokens written ``<image xN>``."""
    text = tokenizer.decode(ids.tolist(), skip_special_tokens=False)
    return re.sub(r"(<\|image_pad\|>)+", lambda m: f"<image x{m.group(0).count('<|image_pad|>')}>", text)
