"""Model loading: local folders, clear errors, the quantized path through bitsandbytes, and models
dispatched by accelerate (offloaded to disk, in part or whole)."""

import importlib.util

import pytest
import transformers
from accelerate import disk_offload

from ngram_assisted import MultiDynaGram, ngram_assisted_speculative_generate
from sampling import autoregressive_generate, beam_search_generate, speculative_generate
from tests.saved_model import save_tiny_chat_model
from utils.loading import check_4bit_runs_here, end_token_ids, load_model

needs_bitsandbytes = pytest.mark.skipif(
    importlib.util.find_spec("bitsandbytes") is None, reason="bitsandbytes is the optional 'quant' extra"
)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny_chat_model(tmp_path_factory.mktemp("tiny"), max_positions=256)


@pytest.fixture(scope="module")
def wide_folder(tmp_path_factory):
    """Linears with 64 and 128 in-features: bitsandbytes' 4-bit kernels run them on every CPU."""
    return save_tiny_chat_model(tmp_path_factory.mktemp("wide"), max_positions=256, hidden=64)


def test_load_a_local_folder(folder):
    model, tokenizer = load_model(str(folder), dtype="float32")
    assert not model.training
    assert end_token_ids(model, tokenizer) == [2]
    assert len(autoregressive_generate(tokenizer("w5 w6")["input_ids"], model, max_gen_len=5)) == 5


def test_bad_arguments(folder):
    with pytest.raises(ValueError, match="dtype"):
        load_model(str(folder), dtype="float13")
    with pytest.raises(ValueError, match="load_in_8bit"):
        load_model(str(folder), load_in_8bit=True, load_in_4bit=True)
    with pytest.raises(ValueError, match="device_map"):
        load_model(str(folder), max_memory={"cpu": "1MB"})


@needs_bitsandbytes
@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_model_runs_every_method_exactly(wide_folder, bits):
    model, tokenizer = load_model(str(wide_folder), load_in_8bit=bits == 8, load_in_4bit=bits == 4)
    assert any("bitsandbytes" in type(m).__module__ for m in model.modules())
    inputs = tokenizer("w5 w6 w7 w5 w6 w7 w5")["input_ids"]
    reference = autoregressive_generate(inputs, model, max_gen_len=12)
    out, _ = ngram_assisted_speculative_generate(inputs, MultiDynaGram(3), model, max_gen_len=12)
    assert out == reference


@needs_bitsandbytes
def test_a_4bit_model_this_cpu_cannot_run_is_refused_clearly(folder):
    """The 32-wide model breaks bitsandbytes' AVX-512 kernel; say so, on every CPU (the kernel's
    presence is faked, so that machines without AVX-512 check the same rule)."""
    from bitsandbytes.functional import has_avx512bf16

    if has_avx512bf16():
        with pytest.raises(ValueError, match="block size 64"):
            load_model(str(folder), load_in_4bit=True)
    import bitsandbytes as bnb
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    model = AutoModelForCausalLM.from_pretrained(folder, quantization_config=BitsAndBytesConfig(load_in_4bit=True))
    linears = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert linears
    for module in linears:
        module.support_avx512bf16_for_cpu = True
    with pytest.raises(ValueError, match="in-features"):
        check_4bit_runs_here(model)


@pytest.mark.parametrize("where", ["part", "all"])
def test_models_offloaded_to_disk_give_the_same_tokens(folder, tmp_path, where):
    """accelerate's dispatch: part of the layers (or all: `model.device` is then `meta`) on disk."""
    plain, tokenizer = load_model(str(folder))
    if where == "all" and int(transformers.__version__.split(".")[0]) < 5:
        # 4.57's loader cannot place a whole model on disk (a SafetensorError): accelerate can.
        offloaded, _ = load_model(str(folder))
        disk_offload(offloaded, offload_dir=str(tmp_path), execution_device="cpu")
    else:
        device_map = {"": "disk"} if where == "all" else {
            "model.embed_tokens": "cpu", "model.layers.0": "disk", "model.layers.1": "cpu", "model.norm": "cpu",
            "model.rotary_emb": "cpu", "lm_head": "disk"}
        offloaded, _ = load_model(str(folder), device_map=device_map, offload_folder=tmp_path)
    assert (offloaded.device.type == "meta") == (where == "all")  # all on disk: no data on any device
    inputs = tokenizer("w5 w6 w7 w5 w6 w7 w5")["input_ids"]
    common = dict(max_gen_len=10)
    assert autoregressive_generate(inputs, offloaded, **common) == autoregressive_generate(inputs, plain, **common)
    assert beam_search_generate(inputs, offloaded, **common) == beam_search_generate(inputs, plain, **common)
    reference = autoregressive_generate(inputs, plain, **common)
    assert speculative_generate(inputs, plain, offloaded, **common)[0] == reference  # offloaded target
    assert speculative_generate(inputs, offloaded, plain, **common)[0] == reference  # offloaded drafter
    assert ngram_assisted_speculative_generate(inputs, MultiDynaGram(3), offloaded, **common)[0] == reference


def test_an_offline_model_not_installed_names_the_make_target(monkeypatch):
    from utils import offline_models

    missing = offline_models.OfflineModel(
        name="missing-model", title="Missing", gguf="missing.gguf", parts=(("no_such_part_module1", "data/p.bin"),),
        sha256="0" * 64, packages=("no-such-part-module1==1.0",), make_target="models", size_bytes=10**9)
    monkeypatch.setitem(offline_models.OFFLINE_MODELS, "missing-model", missing)
    with pytest.raises(FileNotFoundError, match="make models"):
        load_model("missing-model")


def test_offline_names_are_known():
    from utils.offline_models import offline_model

    assert offline_model(None).name == "smollm2-135m-instruct"
    assert offline_model("Qwen2.5-Coder-1.5B-Instruct").name == "qwen2.5-coder-1.5b-instruct"
    assert offline_model("gemma-3-270m").sha256
    assert offline_model("org/some-model") is None


def test_a_folder_that_does_not_exist_and_an_unreachable_hub_fail_at_once(monkeypatch, tmp_path):
    import time

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from utils import loading

    loading.hub_reachable.cache_clear()
    start = time.perf_counter()
    with pytest.raises(FileNotFoundError, match="no model folder"):
        load_model(str(tmp_path / "no_such_folder"))
    with pytest.raises(FileNotFoundError, match="Hub cannot be reached"):
        load_model("no-such-org/no-such-model")
    with pytest.raises(FileNotFoundError, match="without a config.json"):
        load_model(str(tmp_path))
    assert time.perf_counter() - start < 5
    loading.hub_reachable.cache_clear()


def test_a_model_folder_without_tokenizer_files_says_so_in_one_line(folder, tmp_path):
    import shutil

    bare = tmp_path / "weights-only"
    bare.mkdir()
    for file in ("config.json", "model.safetensors", "generation_config.json"):
        if (folder / file).exists():
            shutil.copy(folder / file, bare / file)
    with pytest.raises(FileNotFoundError) as error:
        load_model(str(bare))
    message = str(error.value)
    assert str(bare) in message and "no tokenizer files" in message and "\n" not in message


def test_a_first_load_shows_one_bar_per_step_in_units_a_person_reads(monkeypatch):
    """Bars in MB and tensors, never a rate (a slow step would read "s/B"); transformers' own
    bars are off inside a step (no nested bars) and its GGUF tensor loop counts on ours."""
    import io
    import time

    import transformers.modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    from utils import offline_models
    from utils.offline_models import OFFLINE_MODELS, _own_bars, _progress, _Step

    err = io.StringIO()
    monkeypatch.setattr(offline_models.sys, "stderr", err)
    monkeypatch.delenv(offline_models.PROGRESS_ENV, raising=False)
    with _progress("Assembling x", 98.4, "MB") as bar:
        bar.update(50.0)
    with _Step("Reading x's GGUF file (once)") as step:
        time.sleep(0.6)
    step.finish()  # idempotent
    original, ended = gguf_utils.tqdm, []
    with _own_bars(OFFLINE_MODELS["smollm2-135m-instruct"], lambda: ended.append(True)):
        assert not hf_logging.is_progress_bar_enabled()
        assert list(gguf_utils.tqdm(["a", "b"], desc="Converting and de-quantizing GGUF tensors...")) == ["a", "b"]
    assert gguf_utils.tqdm is original and hf_logging.is_progress_bar_enabled() and ended == [True]
    text = err.getvalue()
    assert "/98 MB [" in text and "/2 tensors [" in text and "Reading x's GGUF file (once) ... 00:00" in text
    assert "De-quantizing smollm2-135m-instruct (once)" in text and "/B" not in text and "it/s" not in text


def test_a_gguf_files_metadata_is_parsed_once_while_it_is_assembled(tmp_path):
    """Inside `_one_reader` every `gguf.GGUFReader` of one file is the same reader (transformers makes three: the
    tokenizer's, the config's, the tensors'), holding the file's fields; outside it a fresh one each time."""
    import gguf
    import numpy as np

    from utils.offline_models import _one_reader

    writer = gguf.GGUFWriter(tmp_path / "tiny.gguf", "llama")
    writer.add_token_list(["<s>", "a", "bc"])
    writer.add_tensor("w", np.arange(8, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    original = gguf.GGUFReader
    with _one_reader():
        first = gguf.GGUFReader(tmp_path / "tiny.gguf")
        assert gguf.GGUFReader(str(tmp_path / "tiny.gguf")) is first and "tokenizer.ggml.tokens" in first.fields
        assert [t.name for t in first.tensors] == ["w"]
    assert gguf.GGUFReader is original and original(tmp_path / "tiny.gguf") is not first


def test_the_real_models_dtype_is_measured_once_per_machine(monkeypatch, tmp_path):
    """`fastest_dtype`: timed once on a machine and kept, so that every later process there loads the same dtype (a
    per-process timing once took float32 on a busy moment where bfloat16 runs 1.7x faster)."""
    import torch

    from utils import loading
    from utils.lean import native

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    monkeypatch.setattr(native, "bfloat16_arithmetic", lambda: True)
    timings = []
    monkeypatch.setattr(loading, "_time_dtypes", lambda: timings.append(1) or torch.bfloat16)
    try:
        for _ in range(3):  # three "processes"
            loading.fastest_dtype.cache_clear()
            assert loading.fastest_dtype() == torch.bfloat16
        assert timings == [1] and len(list(tmp_path.glob("kernels/dtype-*.json"))) == 1
        monkeypatch.setattr(native, "bfloat16_arithmetic", lambda: False)
        monkeypatch.setenv(native.NATIVE_ENV, "0")  # neither bfloat16 arithmetic nor our kernel: float32, untimed
        loading.fastest_dtype.cache_clear()
        assert loading.fastest_dtype() == torch.float32 and timings == [1]
    finally:
        loading.fastest_dtype.cache_clear()


@pytest.mark.parametrize("held", ["bfloat16", "float32", "float16"])
def test_a_users_checkpoint_loads_in_the_dtype_its_weights_take_here(held, monkeypatch, tmp_path):
    """A folder or Hub name with no `dtype` asked: a bfloat16 checkpoint loads as the bundled real models do (the faster
    of float32 and bfloat16 here, `fastest_dtype`: it once loaded in float32, on the Python layers, slower than
    transformers' own bfloat16); a float32 one in float32; a float16 one in float32 (bfloat16 would round it)."""
    import torch

    from tests.saved_model import save_tiny_chat_model
    from utils import loading

    folder = save_tiny_chat_model(tmp_path / "model")
    model, _ = loading.load_model(str(folder), dtype=held)
    model.save_pretrained(folder)  # the checkpoint now holds `held` weights and says so in its config
    monkeypatch.setattr(loading, "fastest_dtype", lambda: torch.bfloat16)  # as on a CPU where bfloat16 runs faster
    model, _ = loading.load_model(str(folder))
    assert model.dtype == (torch.bfloat16 if held == "bfloat16" else torch.float32)
