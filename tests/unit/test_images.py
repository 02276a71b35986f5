"""Rows with images: every form a row may give them in, the errors that name a bad one, how they sit on a
batch, and what a run with images refuses (a text-only model, engine or option)."""

from __future__ import annotations

import base64
import json
import random

import pytest
import torch

from reroll.config.schema import RunConfig
from reroll.config.vision import image_problems, vision_model_problems
from reroll.data.chat import ChatTemplateError, PromptFormat
from reroll.data.datasets import load_samples
from reroll.data.images import ImageError, encode_image, open_image, pil, row_images
from reroll.data.shapes import draw_shapes
from reroll.data.types import ImageInputs, ImagePrompt, TrainBatch, padded_images, prompt_response_batch
from reroll.pipelines.preflight import check_inputs


@pytest.fixture(scope="module")
def png() -> bytes:
    return encode_image(draw_shapes(2, random.Random(0), 16))


@pytest.fixture(scope="module")
def tiny_vl(tmp_path_factory) -> str:
    from reroll.models.tiny_vision import build_tiny_vl_model

    return str(build_tiny_vl_model(tmp_path_factory.mktemp("vl") / "m", alphabet="0123456789 abc?"))


def test_each_form_of_a_row_image_gives_the_same_image(tmp_path, png):
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "a.png").write_bytes(png)
    b64 = base64.b64encode(png).decode()
    forms = {
        "path relative to the data file": "img/a.png",
        "absolute path": str(tmp_path / "img" / "a.png"),
        "base64": b64,
        "data URI": f"data:image/png;base64,{b64}",
        "datasets Image, undecoded": {"bytes": png, "path": None},
        "datasets Image, decoded": open_image(png),
    }
    want = open_image(png).tobytes()
    for what, value in forms.items():
        [got] = row_images("t.jsonl: row 1", {"images": value}, "images", tmp_path)
        assert open_image(got).tobytes() == want, what
    two = row_images("t.jsonl: row 1", {"images": ["img/a.png", b64]}, "images", tmp_path)
    assert len(two) == 2
    assert row_images("t.jsonl: row 1", {"question": "q"}, "images", tmp_path) == ()


def test_a_bad_image_is_named_by_file_row_and_image(tmp_path, png):
    (tmp_path / "broken.png").write_bytes(png[: len(png) // 2])  # truncated: the header reads, the data not
    cases = {
        "broken.png": "does not open as an image",
        "missing.png": "no file",
        "https://example.com/a.png": "is a URL",
        "data:image/png,abc": "must be base64",
    }
    for value, why in cases.items():
        with pytest.raises(ImageError, match=why) as e:
            row_images("train.jsonl: row 7", {"images": ["img/ok.png", value][1:]}, "images", tmp_path)
        assert "train.jsonl: row 7: image 1 of field 'images'" in str(e.value)
    with pytest.raises(ImageError, match="is int, not an image"):
        row_images("t: row 1", {"images": 3}, "images", tmp_path)


def test_samples_carry_their_images_out_of_the_row(tmp_path, png, tiny_vl):
    rows = [
        {"question": "how many?", "answer": "2", "images": base64.b64encode(png).decode()},
        {"question": "no picture", "answer": "0"},
    ]
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    from reroll.models.loading import load_tokenizer

    fmt = PromptFormat(load_tokenizer(tiny_vl))
    with_image, text_only = load_samples(
        [str(data)], template="{question}", render=fmt.prompt, image_field="images"
    )
    assert with_image.images == (png,) and "images" not in with_image.row  # the reward's row: no pixels
    assert with_image.prompt == "<|user|><|vision_start|><|image_pad|><|vision_end|>how many?<|assistant|>"
    assert with_image.engine_prompt == ImagePrompt(with_image.prompt, (png,))
    assert text_only.images == () and text_only.engine_prompt == "<|user|>no picture<|assistant|>"
    (tmp_path / "bad.jsonl").write_text(json.dumps({**rows[0], "images": "bm90IGFuIGltYWdl"}) + "\n")
    with pytest.raises(ImageError, match=r"bad\.jsonl: row 1: image 1"):
        load_samples([str(tmp_path / "bad.jsonl")], template="{question}", image_field="images")


def test_raw_prompts_cannot_place_images(tiny_vl):
    from reroll.models.loading import load_tokenizer

    raw = PromptFormat(load_tokenizer(tiny_vl), chat_template=False)
    with pytest.raises(ChatTemplateError, match="need a chat template that places them"):
        raw.prompt("how many?", images=1)


def test_the_processor_expands_each_placeholder_to_its_image_tokens(tiny_vl, png):
    from reroll.models.loading import load_tokenizer
    from reroll.models.vision import VisionProcessor

    tok = load_tokenizer(tiny_vl)
    vision = VisionProcessor(tiny_vl, tok, max_pixels=32 * 32)
    text = PromptFormat(tok).prompt("how many?", images=2)
    big = encode_image(pil().new("RGB", (32, 32), "white"))
    ids, inputs = vision.encode(text, [png, big])
    # a 16x16 image is 4x4 patches of 4 pixels (2x2 tokens after the 2x2 merge), a 32x32 one 8x8 (16)
    assert inputs.image_grid_thw.tolist() == [[1, 4, 4], [1, 8, 8]]
    assert inputs.pixel_values.shape == (16 + 64, 3 * 2 * 4 * 4)
    assert ids.count(vision.image_token_id) == 4 + 16
    with pytest.raises(Exception, match="1 image placeholders"):
        vision.encode(PromptFormat(tok).prompt("x", images=1), [png, png])


def test_a_batch_keeps_each_rows_images_through_select_and_trim():
    a = ImageInputs(torch.arange(8.0).reshape(4, 2), torch.tensor([[1, 2, 2]]))
    b = ImageInputs(torch.arange(4.0).reshape(2, 2) + 100, torch.tensor([[1, 1, 2]]))
    batch = prompt_response_batch([([1, 2, 3], [4]), ([5], [6, 7]), ([8, 9], [1])], pad_token_id=0)
    batch.pixel_values, batch.image_grid_thw = padded_images([a, None, b])
    assert batch.pixel_values.shape == (3, 4, 2) and batch.image_grid_thw.shape == (3, 1, 3)
    joined = batch.images()
    assert torch.equal(joined.pixel_values, torch.cat([a.pixel_values, b.pixel_values]))
    assert joined.image_grid_thw.tolist() == [[1, 2, 2], [1, 1, 2]]
    last = batch.select(torch.tensor([2])).trim()  # one row, 3 tokens wide: the image fields stay whole
    assert torch.equal(last.images().pixel_values, b.pixel_values)
    assert batch.select(torch.tensor([1])).images() is None
    assert TrainBatch.images(prompt_response_batch([([1], [2])], 0)) is None


def _cfg(tmp_path, **sections) -> RunConfig:
    train = tmp_path / "train.jsonl"
    if not train.exists():
        train.write_text(json.dumps({"question": "q", "answer": "1"}) + "\n")
    data = {
        "pipeline": "rlvr",
        "output_dir": str(tmp_path / "runs" / "{name}"),
        "model": {"path": "Qwen/Qwen2.5-VL-7B-Instruct"},
        "data": {"train_files": [str(train)]},
        "rollout": {"batch_size": 4, "group_size": 4},
    }
    for key, value in sections.items():
        data[key] = {**data[key], **value} if isinstance(data.get(key), dict) else value
    return RunConfig.model_validate(data)


def test_what_a_run_with_images_refuses(tmp_path):
    assert image_problems(_cfg(tmp_path), "qwen2_5_vl") == []  # hf's spec is multimodal
    found = dict(image_problems(_cfg(tmp_path, model={"path": "Qwen/Qwen2.5-7B"}), "qwen2"))
    assert "reads text only" in found["model.path"] and "data.image_field=null" in found["model.path"]
    found = dict(image_problems(_cfg(tmp_path, rollout={"engine": "sglang"}), "qwen2_5_vl"))
    assert "takes text prompts only" in found["rollout.engine"] and "hf, vllm" in found["rollout.engine"]
    found = dict(image_problems(_cfg(tmp_path, rollout={"partial_rollouts": True}), None))
    assert "do not carry the images" in found["rollout.partial_rollouts"]
    assert (
        "not packed"
        in dict(vision_model_problems(_cfg(tmp_path, optim={"packing": True}), "qwen2_5_vl"))["optim.packing"]
    )
    assert vision_model_problems(_cfg(tmp_path, optim={"packing": True}), "qwen2") == []


def test_validate_names_the_row_whose_image_does_not_open(tmp_path, png):
    b64 = base64.b64encode(png).decode()
    rows = [{"question": "q", "answer": "1", "images": [b64]} for _ in range(150)]
    rows[120]["images"] = ["img/none.png"]  # past the first 100 rows validate reads for the fields
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    found = {p.path: p.message for p in check_inputs(_cfg(tmp_path))}
    assert "train.jsonl: row 121: image 1 of field 'images': no file" in found["data.train_files[0]"]
    rows[120]["images"] = [b64]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert "data.train_files[0]" not in {p.path for p in check_inputs(_cfg(tmp_path))}
    found = {p.path: p.message for p in check_inputs(_cfg(tmp_path, model={"path": "Qwen/Qwen2.5-7B"}))}
    assert "reads text only" in found["model.path"]


def test_the_vision_example_validates_with_image_rows(tmp_path, png):
    """examples/qwen2.5-vl-7b-rlvr_fsdp2 with rows of one's own that carry images (the hub data is not
    read here): validate finds nothing on the 8 GPUs it names; a text-only engine there is refused."""
    from reroll.config.loader import load_config
    from reroll.pipelines import preflight
    from reroll.pipelines.preflight_machine import Machine

    (tmp_path / "fig.png").write_bytes(png)
    (tmp_path / "rows.jsonl").write_text(
        json.dumps({"question": "q", "answer": "2", "images": ["fig.png"]}) + "\n"
    )
    path = "examples/qwen2.5-vl-7b-rlvr_fsdp2/config.yaml"
    rows = [f"data.train_files=[{tmp_path}/rows.jsonl]", f"data.eval_files=[{tmp_path}/rows.jsonl]"]
    args = [*rows, f"output_dir={tmp_path}/run"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(preflight, "package_problems", lambda cfg, **kw: [])
        assert check_inputs(load_config(path, RunConfig, args), Machine(cpus=128.0, gpus=8)) == []
        found = check_inputs(
            load_config(path, RunConfig, [*args, "rollout.engine=sglang"]), Machine(cpus=128.0, gpus=8)
        )
    assert [p.path for p in found] == ["rollout.engine"]


def test_a_datasets_image_column_gives_the_rows_images(tmp_path, png):
    """A Hugging Face dataset with an Image feature (here saved with save_to_disk, read as the hub path
    reads it): each row's decoded image becomes the sample's, as PNG bytes of the same pixels."""
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict(
        {"question": ["q1", "q2"], "answer": ["2", "2"], "images": [[png], [png]]}
    )
    ds.cast_column("images", datasets.Sequence(datasets.Image())).save_to_disk(str(tmp_path / "ds"))
    samples = load_samples([str(tmp_path / "ds")], template="{question}", image_field="images")
    assert [len(s.images) for s in samples] == [1, 1] and "images" not in samples[0].row
    assert open_image(samples[0].images[0]).tobytes() == open_image(png).tobytes()


def test_a_pair_rows_image_reaches_both_of_its_batch_rows(tmp_path, png, tiny_vl):
    """Preference pairs (pipelines dpo, reward_model): the prompt's image, shared by the chosen and the
    rejected response, is placed as a data row's prompt places it, and both batch rows of the pair carry
    its expanded image tokens and its pixels, through the stacked forward and the cuts by rank."""
    from reroll.data.datasets import DatasetError
    from reroll.data.preferences import load_pairs, pair_batch
    from reroll.models.loading import load_tokenizer
    from reroll.models.vision import VisionProcessor

    big = encode_image(draw_shapes(3, random.Random(1), 32))
    (tmp_path / "fig.png").write_bytes(big)
    rows = [
        {"prompt": "abc?", "chosen": "2", "rejected": "1", "images": [base64.b64encode(png).decode()]},
        {"prompt": "c?", "chosen": "3", "rejected": "4"},  # text only
        {"prompt": "b?", "chosen": "3", "rejected": "2", "images": "fig.png"},  # beside the file
    ]
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    tok = load_tokenizer(tiny_vl)
    fmt, vision = PromptFormat(tok), VisionProcessor(tiny_vl, tok, max_pixels=32 * 32)
    pairs = load_pairs([str(tmp_path / "pairs.jsonl")], tok, fmt=fmt, image_field="images")
    assert [p.images for p in pairs] == [(png,), (), (big,)]
    assert pairs[0].prompt == fmt.prompt("abc?", images=1) and pairs[1].prompt == fmt.prompt("c?")

    batch = pair_batch(pairs, tok, vision)
    want = [vision.images(p.images) for p in pairs]  # 16x16: 4 image tokens, 32x32: 16
    for i, tokens in enumerate([4, 0, 16]):
        for side in (batch.chosen, batch.rejected):
            row = side.select([i])
            ids = row.input_ids[0][row.attention_mask[0] & ~row.response_mask[0]]
            assert int((ids == vision.image_token_id).sum()) == tokens, (i, side)
            got = row.images()
            if want[i] is None:
                assert got is None
            else:
                assert torch.equal(got.pixel_values, want[i].pixel_values)
                assert torch.equal(got.image_grid_thw, want[i].image_grid_thw)
    stacked = batch.stacked().images()  # one forward: the chosen rows, then the rejected
    order = [want[0], want[2], want[0], want[2]]
    assert torch.equal(stacked.pixel_values, torch.cat([w.pixel_values for w in order]))
    assert torch.equal(stacked.image_grid_thw, torch.cat([w.image_grid_thw for w in order]))
    second = batch.split(2)[1].stacked().images()  # a rank's share keeps its pairs' images
    assert second is not None and torch.equal(second.pixel_values, torch.cat([want[2].pixel_values] * 2))

    with pytest.raises(ValueError, match="needs the model's VisionProcessor"):
        pair_batch(pairs, tok)
    with pytest.raises(
        DatasetError, match=r"pairs\.jsonl: row 1: the prompt has 1 images, which only a chat"
    ):
        load_pairs(
            [str(tmp_path / "pairs.jsonl")],
            tok,
            fmt=PromptFormat(tok, chat_template=False),
            image_field="images",
        )
    chat = [{"role": "user", "content": "abc?"}]  # a message list: the images go before its text
    (tmp_path / "chat.jsonl").write_text(json.dumps({**rows[0], "prompt": chat}) + "\n")
    [listed] = load_pairs([str(tmp_path / "chat.jsonl")], tok, image_field="images")
    assert listed.prompt == pairs[0].prompt and listed.images == (png,)


def test_validate_checks_the_images_of_preference_pairs(tmp_path, png):
    """Pairs with images: the first that does not open is named by file and row, a text-only model is
    refused, so is a reward model (no sequence-classification head on a vision-language model) and
    packing; a run without an engine is not asked for a multimodal one."""
    b64 = base64.b64encode(png).decode()
    rows = [{"prompt": "q", "chosen": "2", "rejected": "1", "images": [b64]} for _ in range(3)]
    rows[2]["images"] = ["none.png"]
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(r) + "\n" for r in rows))

    def found(pipeline: str, **sections) -> dict[str, str]:
        cfg = {
            "pipeline": pipeline,
            "output_dir": str(tmp_path / "runs" / "{name}"),
            "model": {"path": "Qwen/Qwen2.5-VL-7B-Instruct"},
            "preference": {"train_files": [str(pairs)]},
            "rollout": {"engine": "sglang"},  # text only, but no pipeline here starts an engine
            **sections,
        }
        return {p.path: p.message for p in check_inputs(RunConfig.model_validate(cfg))}

    assert (
        "pairs.jsonl: row 3: image 1 of field 'images': no file" in found("dpo")["preference.train_files[0]"]
    )
    rows[2]["images"] = [b64]
    pairs.write_text("".join(json.dumps(r) + "\n" for r in rows))
    dpo = found("dpo")
    assert "preference.train_files[0]" not in dpo and "rollout.engine" not in dpo and "pipeline" not in dpo
    assert "reads text only" in found("dpo", model={"path": "Qwen/Qwen2.5-7B"})["model.path"]
    assert "sequence-classification head" in found("reward_model")["pipeline"]
    assert "not packed" in found("dpo", optim={"packing": True})["optim.packing"]
