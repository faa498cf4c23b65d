"""Build the C++ do-nothing picker (``echo_picker.cc``) for ``bench_epp.py --floor cpp``.

Needs Debian's ``g++ protobuf-compiler protobuf-compiler-grpc libgrpc++-dev
libprotobuf-dev``.  Envoy's ``.proto`` files are not installed anywhere here, so the
ext_proc service's descriptors (and their imports) are taken from the ``xds-protos``
Python package and handed to ``protoc`` as a descriptor set.

    python tests/bench/epp_floor/build.py [--out DIR]     # prints the binary's path
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
NEEDED = ("g++", "protoc", "grpc_cpp_plugin", "pkg-config")


def descriptor_set(path: Path) -> list[str]:
    """Write the ext_proc service's file and every file it imports as a
    ``FileDescriptorSet`` to ``path``; the files' names, imports first."""
    from envoy.service.ext_proc.v3 import external_processor_pb2
    from google.protobuf import descriptor_pb2

    files: dict[str, descriptor_pb2.FileDescriptorProto] = {}

    def add(fd) -> None:  # type: ignore[no-untyped-def]
        if fd.name in files:
            return
        for dep in fd.dependencies:
            add(dep)
        proto = descriptor_pb2.FileDescriptorProto()
        fd.CopyToProto(proto)
        files[fd.name] = proto

    add(external_processor_pb2.DESCRIPTOR)
    path.write_bytes(
        descriptor_pb2.FileDescriptorSet(file=list(files.values())).SerializeToString()
    )
    return list(files)


def build(out: Path) -> Path:
    missing = [tool for tool in NEEDED if shutil.which(tool) is None]
    if missing:
        raise SystemExit(
            f"build.py: {', '.join(missing)} not found (apt-get install g++ pkg-config "
            "protobuf-compiler protobuf-compiler-grpc libgrpc++-dev libprotobuf-dev)"
        )
    gen = out / "gen"
    gen.mkdir(parents=True, exist_ok=True)
    names = descriptor_set(out / "set.pb")
    ours = [n for n in names if not n.startswith("google/protobuf/")]
    protoc = ["protoc", f"--descriptor_set_in={out / 'set.pb'}"]
    subprocess.run([*protoc, f"--cpp_out={gen}", *ours], check=True)
    plugin = shutil.which("grpc_cpp_plugin")
    service = "envoy/service/ext_proc/v3/external_processor.proto"
    subprocess.run(
        [*protoc, f"--grpc_out={gen}", f"--plugin=protoc-gen-grpc={plugin}", service], check=True
    )
    flags = subprocess.run(
        ["pkg-config", "--cflags", "--libs", "grpc++", "protobuf"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    sources = [str(p) for p in sorted(gen.rglob("*.cc"))]
    binary = out / "echo_picker"
    subprocess.run(
        [
            "g++",
            "-O2",
            "-std=c++17",
            f"-I{gen}",
            str(HERE / "echo_picker.cc"),
            *sources,
            "-o",
            str(binary),
            *flags,
            "-lgrpc++_reflection",
        ],
        check=True,
    )
    return binary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("/tmp/kvroute-epp-floor"))
    a = ap.parse_args(argv)
    print(build(a.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
