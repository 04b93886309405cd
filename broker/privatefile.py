"""Files only the broker's user may read: the users file, the admin token, the SCRAM salt secret.

Written atomically (a reader sees the old file or the new one, never half of it) with mode 0600, in a
folder created 0700; read back only while still a regular file of ours that no one else can read, so a
file someone replaced or loosened is not trusted (it is written anew instead).
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

__all__ = ["write_private", "read_private"]


def write_private(path: Path, text: str) -> None:
    """Replace `path` with `text`, mode 0600 (mkstemp creates it so), its folder 0700 when created."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def read_private(path: Path) -> str | None:
    """`path`'s text, stripped, if it is a regular file of ours with mode 0600 or stricter; else None
    (missing, unreadable, someone else's, loosened permissions, not text)."""
    try:
        info = path.lstat()
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
            return None
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
