"""Loading models and forwarding them on padded rows: the one place trainer, critic and engine use.

Per-token outputs follow one alignment (``reroll.data.types``): column ``t`` belongs to token ``t``
and is read off the model's output at position ``t - 1``, the last position that has not seen
token ``t``; column 0 is 0. The pure functions that read them off the logits are in
``reroll.algorithms.logprobs`` (and ``reroll.algorithms.value.token_values`` for a critic).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.utils import logging as hf_logging

from reroll.algorithms.logprobs import token_logprobs
from reroll.errors import UserError
from reroll.models.packed_attention import attend_rows_apart, wants_packing
from reroll.models.vision_attention import attend_segments_batched

if TYPE_CHECKING:
    from reroll.config.schema import RunConfig

log = logging.getLogger(__name__)
hf_logging.disable_progress_bar()  # one line per step is ours; no per-load progress bars

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """The tokenizer saved beside the model; pad falls back to eos."""
    try:
        tok = AutoTokenizer.from_pretrained(path)
    except OSError as e:
        raise UserError(f"cannot load a tokenizer from model.path {path!r}: {e}") from e
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def parameter_counts(model: torch.nn.Module) -> tuple[float, float]:
    """``(all parameters, those in routed experts)`` of ``model`` (sharded ones at their full size, as
    FSDP2's DTensors report it): what ``reroll.config.memory.Shape`` needs of a model's state."""
    params = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    return float(params), float(experts)


def load_causal_lm(
    path: str | Path, dtype: str = "float32", device: str | torch.device = "cpu"
) -> PreTrainedModel:
    """A Hugging Face causal LM from a local directory or hub id, in ``dtype`` on ``device``; a
    vision-language model (``reroll.models.vision``) as ``AutoModelForImageTextToText``. On ``"meta"``,
    its structure alone, nothing read (``empty_model``)."""
    try:
        auto = AutoModelForImageTextToText if _is_vision_language(path) else AutoModelForCausalLM
        if torch.device(device).type == "meta":
            return empty_model(auto, AutoConfig.from_pretrained(str(path)), dtype)
        model = auto.from_pretrained(str(path), dtype=DTYPES[dtype])
    except OSError as e:
        raise UserError(f"cannot load a model from model.path {str(path)!r}: {e}") from e
    return model.to(device)


def _is_vision_language(path: str | Path) -> bool:
    from reroll.models.vision import is_vision_language

    try:
        return is_vision_language(AutoConfig.from_pretrained(str(path)))
    except (OSError, ValueError):  # from_pretrained's own error says what is wrong
        return False


def load_value_model(
    path: str | Path, dtype: str = "float32", device: str | torch.device = "cpu"
) -> PreTrainedModel:
    """A critic: the model at ``path`` with a one-output linear head per position, ``(B, T, 1)`` scores.

    Loaded as ``AutoModelForTokenClassification`` (``num_labels=1``, no dropout), so a causal LM
    checkpoint gives the body and a new head. Parameters the checkpoint lacks (the new head) start
    at zero, so every value starts at 0; a saved critic loads its own head. ``save_pretrained``
    writes it back in the same form.
    """

    def configure(config: Any) -> None:
        config.num_labels, config.classifier_dropout = 1, 0.0

    return _with_zero_head(AutoModelForTokenClassification, "value model", path, configure, dtype, device)


def load_sequence_classifier(
    path: str | Path, dtype: str = "float32", device: str | torch.device = "cpu"
) -> PreTrainedModel:
    """A reward model: the model at ``path`` as ``AutoModelForSequenceClassification`` with one output,
    the score of each row's last non-pad token, ``(B, 1)``.

    A causal LM checkpoint gives the body and a new head, which starts at zero (every reward 0); a
    saved reward model loads its own. ``config.pad_token_id`` is set from the tokenizer saved beside
    the model where the config lacks it (the head finds each row's last token by it), so what
    ``save_pretrained`` writes loads with ``AutoModelForSequenceClassification.from_pretrained`` and
    scores batches as it trained.
    """

    def configure(config: Any) -> None:
        config.num_labels = 1
        if config.pad_token_id is None:
            config.pad_token_id = load_tokenizer(str(path)).pad_token_id

    return _with_zero_head(AutoModelForSequenceClassification, "reward model", path, configure, dtype, device)


def _with_zero_head(
    auto_cls: Any,
    what: str,
    path: str | Path,
    configure: Callable[[Any], None],
    dtype: str,
    device: str | torch.device,
) -> PreTrainedModel:
    """``auto_cls`` from ``path`` with its config changed by ``configure``; parameters the checkpoint
    lacks (a new scoring head) start at zero. A load failure is a ``UserError`` naming ``what``. On
    ``"meta"``, its structure alone (``empty_model``)."""
    report = logging.getLogger("transformers.modeling_utils")  # its load report: the new head is expected
    level = report.level
    try:
        report.setLevel(logging.ERROR)
        config = AutoConfig.from_pretrained(str(path))
        configure(config)
        if torch.device(device).type == "meta":
            return empty_model(auto_cls, config, dtype)
        model, info = auto_cls.from_pretrained(
            str(path), config=config, dtype=DTYPES[dtype], output_loading_info=True
        )
    except OSError as e:
        raise UserError(f"cannot load a {what} from {str(path)!r}: {e}") from e
    finally:
        report.setLevel(level)
    missing = set(info["missing_keys"])
    if missing:
        log.info("%s from %s: %s start at zero", what, path, ", ".join(sorted(missing)))
    for name, param in model.named_parameters():
        if name in missing:
            torch.nn.init.zeros_(param)
    return model.to(device)


def empty_model(auto_cls: Any, config: Any, dtype: str) -> PreTrainedModel:
    """``auto_cls.from_config(config)`` in ``dtype`` with its parameters on the meta device (no memory,
    nothing initialised) and its buffers on the host, computed as ``from_pretrained`` computes them (a
    rotary embedding's frequencies are in no checkpoint). What ``reroll.strategies.shard_fill`` fills."""
    with _parameters_on_meta():
        return auto_cls.from_config(config, dtype=DTYPES[dtype])


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Every parameter registered inside the block moves to the meta device as it is registered (before a
    module's ``reset_parameters`` runs on it); buffers are left where they are made."""
    register = torch.nn.Module.register_parameter

    def on_meta(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = type(param)(param.to("meta"), requires_grad=param.requires_grad)

    torch.nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register  # type: ignore[method-assign]


def use_kernels(model: torch.nn.Module, cfg: RunConfig, device: torch.device) -> None:
    """Swap in, in place, the kernels ``cfg`` asks for on ``device`` (where the model will run): torch's
    fused RMSNorm (``model.fused_norm``), where ``optim.packing`` resolves on, attention that keeps
    packed rows apart at each row's own cost (``packed_attention``), and in a vision tower, attention over
    its images and windows batched by length (``model.batched_vision_attention``: ``vision_attention``)."""
    if cfg.model.fused_norm:
        fuse_rms_norms(model)
    if wants_packing(cfg.optim.packing, device, DTYPES[cfg.compute_dtype]) and not attend_rows_apart(model):
        log.info("optim.packing: this model keeps sdpa's attention over the whole packed row (block mask)")
    if cfg.model.batched_vision_attention:  # after attend_rows_apart, whose setting reaches the vision config
        attend_segments_batched(model)


def fuse_rms_norms(model: torch.nn.Module) -> int:
    """Run ``model``'s RMSNorm layers as torch's ``rms_norm``, in place; returns how many.

    Hugging Face's RMSNorm (Llama, Qwen2, Qwen3, Mistral, ...) upcasts to fp32 and normalises in about
    eight elementwise kernels, each of which writes a tensor the size of the layer's input and keeps
    several for the backward pass; ``torch.nn.functional.rms_norm`` is one fused kernel forward and one
    backward on CUDA (fp32 inside) and keeps the input and one value per row. The results differ by
    bf16 rounding only (the weight is applied before the cast back rather than after). A norm class is
    fused only where its own forward gives ``rms_norm``'s result on a random probe (random input and
    weight, fp32): a norm that computes something else (Gemma's ``1 + weight``, a bias, another
    epsilon) keeps its own code. Parameters, buffers and state-dict keys are untouched.
    """
    fused: dict[type, bool] = {}
    count = 0
    for module in model.modules():
        cls = type(module)
        weight, eps = getattr(module, "weight", None), _norm_eps(module)
        plain = isinstance(weight, torch.Tensor) and weight.dim() == 1 and eps is not None
        if not cls.__name__.endswith("RMSNorm") or not plain:
            continue
        if cls not in fused:
            fused[cls] = _computes_rms_norm(module, eps)
            log.debug("%s: %s", cls.__name__, "fused rms_norm" if fused[cls] else "kept (not plain RMSNorm)")
        if fused[cls]:
            module.forward = types.MethodType(_fused_rms_norm_forward, module)
            count += 1
    return count


def _norm_eps(module: torch.nn.Module) -> float | None:
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    return float(eps) if isinstance(eps, (float, int)) else None


def _computes_rms_norm(module: torch.nn.Module, eps: float) -> bool:
    """Whether ``module``'s class computes ``rms_norm(x, weight, eps)``: compared on a CPU copy in fp32
    with random parameters and input (so a weight of ones cannot hide a ``1 + weight``; a module on the
    meta device, built before its weights are read, is probed the same)."""
    probe = copy.deepcopy(module).to_empty(device="cpu").to(torch.float32)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        probe.weight.copy_(torch.rand(probe.weight.shape, generator=gen) + 0.5)
        for name, p in probe.named_parameters():
            if name != "weight":  # a bias, if any: random too, not what to_empty left
                p.copy_(torch.rand(p.shape, generator=gen))
        x = torch.randn(2, 3, probe.weight.shape[0], generator=gen)
        try:
            ours = type(module).forward(probe, x)
        except Exception:  # a norm that needs other arguments is not a plain RMSNorm
            return False
        want = torch.nn.functional.rms_norm(x, probe.weight.shape, probe.weight, eps)
    return (
        isinstance(ours, torch.Tensor) and ours.shape == want.shape and torch.allclose(ours, want, atol=1e-5)
    )


def _fused_rms_norm_forward(self: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    if hidden_states.dtype != self.weight.dtype:  # mixed dtypes: the class's own promotion rules
        return type(self).forward(self, hidden_states)
    return torch.nn.functional.rms_norm(hidden_states, self.weight.shape, self.weight, _norm_eps(self))


def position_ids_from(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip padding: 0, 1, 2, ... over the real tokens of each row."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def sequence_logprobs(
    model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """Forward ``model`` on right-padded rows and return ``(B, T)`` token log-probs."""
    out = model(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids_from(attention_mask)
    )
    return token_logprobs(out.logits, input_ids, temperature)
