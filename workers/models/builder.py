"""Builds a small random-weight Llama checkpoint with its own byte-level BPE tokenizer, offline and
byte-for-byte deterministic, so the whole stack can run without downloading a model."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from filelock import FileLock
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

if TYPE_CHECKING:       # transformers takes seconds to import: only building a model imports it
    from transformers import GenerationConfig, LlamaConfig

CORPUS = Path(__file__).parent / "data" / "corpus.txt"
BOS, PAD, IM_START, IM_END = "<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [BOS, PAD, IM_START, IM_END]  # ids 0..3
EOS = IM_END  # a chat turn ends the generation
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SIZES = {
    "tiny": {"vocab_size": 4096, "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
             "num_key_value_heads": 2, "intermediate_size": 704},
    "small": {"vocab_size": 8192, "hidden_size": 512, "num_hidden_layers": 12, "num_attention_heads": 8,
              "num_key_value_heads": 4, "intermediate_size": 1408},
}
MAX_POSITIONS = 4096
MARKER = "tokenbus_builder.json"  # written by default_model_dir only, after the build is complete


def build_tiny_model(out_dir: str | Path, size: str = "tiny", seed: int = 0) -> Path:
    """Write config, generation config, float32 weights and tokenizer files into out_dir."""
    if size not in SIZES:
        raise ValueError(f"model size {size!r} is not one of {', '.join(SIZES)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(SIZES[size]["vocab_size"])
    config = llama_config(size, tok)
    config.save_pretrained(out)
    generation_config(config).save_pretrained(out)
    write_weights(config, seed, out / "model.safetensors")
    write_tokenizer(tok, out)
    return out


def train_tokenizer(vocab_size: int) -> Tokenizer:
    """A byte-level BPE trained on the shipped corpus, padded with reserved tokens up to vocab_size."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train([str(CORPUS)], trainer)
    missing = vocab_size - tok.get_vocab_size()
    tok.add_special_tokens([f"<|reserved_{i}|>" for i in range(missing)])
    return tok


def llama_config(size: str, tok: Tokenizer) -> LlamaConfig:
    from transformers import LlamaConfig

    dims = SIZES[size] | {"vocab_size": tok.get_vocab_size()}
    return LlamaConfig(
        **dims, tie_word_embeddings=False, max_position_embeddings=MAX_POSITIONS, rope_theta=10000.0,
        initializer_range=0.02, dtype="float32", architectures=["LlamaForCausalLM"],
        bos_token_id=tok.token_to_id(BOS), eos_token_id=tok.token_to_id(EOS), pad_token_id=tok.token_to_id(PAD),
    )


def generation_config(config: LlamaConfig) -> GenerationConfig:
    from transformers import GenerationConfig

    return GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id,
    )


def write_weights(config: LlamaConfig, seed: int, path: Path) -> None:
    from transformers import LlamaForCausalLM

    with torch.random.fork_rng(devices=[]):  # leave the caller's RNG state alone
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).float()
    save_weights({k: v.contiguous() for k, v in model.state_dict().items()}, path)


def save_weights(tensors: dict, path: Path) -> None:
    """model.safetensors, readable as any file the user writes (safetensors writes it 0600), so that a
    container's own user can read a model directory mounted into it."""
    save_file(tensors, str(path), metadata={"format": "pt"})
    os.chmod(path, 0o666 & ~umask())


def umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_tokenizer(tok: Tokenizer, out: Path) -> None:
    """tokenizer.json plus the two files transformers reads; written by hand so they look the same
    under transformers 4 and 5 (5 would move the chat template into chat_template.jinja)."""
    tok.save(str(out / "tokenizer.json"))
    roles = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}
    extra = [t for t in SPECIAL_TOKENS if t not in roles.values()]
    write_json(out / "special_tokens_map.json", roles | {"additional_special_tokens": extra})
    write_json(out / "tokenizer_config.json", roles | {
        "additional_special_tokens": extra,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MAX_POSITIONS,
        "tokenizer_class": "PreTrainedTokenizerFast",
    })


def write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def default_model_dir(size: str = "tiny") -> Path:
    """The cached model at $TOKENBUS_HOME/models/<size>, built on first use (or when the builder
    changed)."""
    def build(tmp: Path) -> None:
        build_tiny_model(tmp, size)
        write_json(tmp / MARKER, {"tokenbus_builder_version": builder_version(), "size": size, "seed": 0})

    return build_once(tokenbus_home() / "models" / size, is_current, build)


def build_once(final: Path, done, build) -> Path:
    """`final`, unless `done(final)` built by `build(tmp)` into a temp dir beside it that is then
    renamed into place, under a file lock: a half-built dir is never seen, two processes build once."""
    if done(final):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(final.parent / f"{final.name}.lock")):
        if done(final):  # another process built it while we waited
            return final
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
        try:
            os.chmod(tmp, 0o777 & ~umask())    # mkdtemp's 0700 would hide the model from a container's user
            build(tmp)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        replace_dir(tmp, final)
    return final


def replace_dir(new: Path, final: Path) -> None:
    """Rename new to final; a stale final is first renamed aside, since rename cannot replace a full dir."""
    if final.exists():
        stale = Path(tempfile.mkdtemp(prefix=f".{final.name}-stale-", dir=final.parent))
        os.replace(final, stale / final.name)
        shutil.rmtree(stale)
    os.replace(new, final)


def tokenbus_home() -> Path:
    return Path(os.environ.get("TOKENBUS_HOME") or Path.home() / ".cache" / "tokenbus")


def builder_version() -> str:
    """Changes whenever this file or the corpus changes, so a cached model built by an older
    builder is rebuilt."""
    return hashlib.sha256(Path(__file__).read_bytes() + CORPUS.read_bytes()).hexdigest()[:16]


def is_current(model_dir: Path) -> bool:
    try:
        stamp = json.loads((model_dir / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return stamp.get("tokenbus_builder_version") == builder_version()
