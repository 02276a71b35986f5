import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2ForCausalLM

from reroll.models.tiny import build_tiny_model, char_tokenizer

ALPHABET = "0123456789+-*= "


@pytest.fixture(scope="module")
def tokenizer():
    return char_tokenizer(ALPHABET)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), alphabet=ALPHABET, hidden_size=64, num_heads=2)


def test_one_token_per_char_no_bos_eos(tokenizer):
    ids = tokenizer("12+34=")["input_ids"]
    assert tokenizer.convert_ids_to_tokens(ids) == ["1", "2", "+", "3", "4", "="]


def test_round_trip_with_spaces(tokenizer):
    text = " 7 * 81 = -9"
    ids = tokenizer(text)["input_ids"]
    assert len(ids) == len(text)
    assert tokenizer.decode(ids) == text


def test_special_tokens(tokenizer):
    assert (tokenizer.pad_token, tokenizer.eos_token, tokenizer.unk_token) == ("<pad>", "<eos>", "<unk>")
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id) == (0, 1, 2)
    ids = tokenizer("46<eos>")["input_ids"]
    assert ids[-1] == tokenizer.eos_token_id and len(ids) == 3
    assert tokenizer.decode(ids, skip_special_tokens=True) == "46"
    # 3 specials + 3 role markers + 15 alphabet characters
    assert len(tokenizer) == 21


def test_chat_template(tokenizer):
    messages = [{"role": "user", "content": "1+2="}, {"role": "assistant", "content": "3"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    assert text == "<|user|>1+2=<|assistant|>3<eos>"
    prompt = tokenizer.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    assert prompt == "<|user|>1+2=<|assistant|>"
    assert len(tokenizer(prompt)["input_ids"]) == 6  # 2 role markers + 4 characters


def test_out_of_alphabet_characters_are_dropped(tokenizer):
    # The byte-level BPE (Qwen2Tokenizer's pipeline) has no unknown token.
    assert tokenizer("1x2")["input_ids"] == tokenizer("12")["input_ids"]


def test_non_ascii_alphabet_is_an_error():
    with pytest.raises(ValueError, match="non-ASCII"):
        char_tokenizer("01é")


def test_head_dim_must_be_supported(tmp_path):
    with pytest.raises(ValueError, match=r"96 // 4 = 24.*use num_heads=3"):
        build_tiny_model(tmp_path, alphabet=ALPHABET, hidden_size=96, num_heads=4)


def test_saved_model_reloads_with_identical_logits(model_dir, tokenizer):
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    reloaded_tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert isinstance(model, Qwen2ForCausalLM)
    assert model.config.tie_word_embeddings and model.config.vocab_size == len(tokenizer)
    assert model.config.hidden_size // model.config.num_attention_heads == 32
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id == model.config.eos_token_id
    assert model.generation_config.pad_token_id == tokenizer.pad_token_id == model.config.pad_token_id
    for text in ("12+34=", " 1 - 2 = -1", "<|user|>1+2=<|assistant|>3<eos><pad>", "7x=\n"):
        assert reloaded_tokenizer(text)["input_ids"] == tokenizer(text)["input_ids"]

    # Rebuilding with the same seed gives the same weights, so the saved model matches a fresh one.
    config = model.config
    torch.manual_seed(0)
    fresh = Qwen2ForCausalLM(config).eval()
    ids = torch.tensor([tokenizer("12+34=")["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(ids).logits, fresh(ids).logits)
    assert model.dtype == torch.float32


def test_same_seed_same_weights(tmp_path):
    a = build_tiny_model(tmp_path / "a", alphabet="01", hidden_size=64, num_heads=2, num_layers=1, seed=3)
    b = build_tiny_model(tmp_path / "b", alphabet="01", hidden_size=64, num_heads=2, num_layers=1, seed=3)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()


def test_a_model_initialised_on_a_device_is_saved_in_its_dtype_and_loads(tmp_path):
    """``init_device`` (the benchmark's 'cuda'; 'cpu:0' takes the same path here): the weights are made
    there in ``dtype`` and saved from host memory, a loadable model of the same shape."""
    out = build_tiny_model(
        tmp_path / "m", alphabet=ALPHABET, hidden_size=64, num_heads=2, dtype="bfloat16", init_device="cpu:0"
    )
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    reference = build_tiny_model(tmp_path / "r", alphabet=ALPHABET, hidden_size=64, num_heads=2)
    base = AutoModelForCausalLM.from_pretrained(reference)
    assert {k: v.shape for k, v in model.state_dict().items()} == {
        k: v.shape for k, v in base.state_dict().items()
    }
    assert all(p.dtype == torch.bfloat16 and torch.isfinite(p).all() for p in model.parameters())
