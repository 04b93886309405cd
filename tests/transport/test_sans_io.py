"""Only ``transport/udp/`` may do I/O: no other transport module imports trio, socket or a clock."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import flowbroker.transport

TRANSPORT = Path(flowbroker.transport.__file__).parent
IO_MODULES = {"trio", "socket", "time", "select", "selectors", "asyncio"}


def imported(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module is not None and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_no_sans_io_module_imports_io_or_a_clock() -> None:
    sans_io = [p for p in TRANSPORT.glob("*.py")]
    assert len(sans_io) > 10 and not any(p.parent.name == "udp" for p in sans_io)
    offenders = {p.name: imported(p) & IO_MODULES for p in sans_io if imported(p) & IO_MODULES}
    assert offenders == {}
    assert "trio" in imported(TRANSPORT / "udp" / "tasks.py")  # the check does see imports


def test_importing_the_transport_package_loads_no_trio_and_no_socket() -> None:
    code = "import sys, flowbroker.transport; print(sorted({'trio', 'socket'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"


def test_the_brokers_udp_data_path_is_sans_io_but_its_shell() -> None:
    """broker/udp/: datapath, ingress, egress and multicast take datagrams and now_ns; only shell.py does I/O."""
    import flowbroker.broker.udp

    folder = Path(flowbroker.broker.udp.__file__).parent
    sans_io = [folder / name for name in ("__init__.py", "datapath.py", "ingress.py", "egress.py", "multicast.py")]
    assert {p.name for p in folder.glob("*.py")} == {p.name for p in sans_io} | {"shell.py"}  # a new module is listed
    offenders = {p.name: imported(p) & IO_MODULES for p in sans_io if imported(p) & IO_MODULES}
    assert offenders == {}
    assert "trio" in imported(folder / "shell.py")
