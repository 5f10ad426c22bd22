"""A checkpoint store that takes its time: ``slowfile://PATH`` is the local file system, except
that every file written takes ``UNBROKEN_TEST_WRITE_SECONDS`` longer to close (a store that needs
a minute, scaled down)."""

import os
import time

import fsspec
from fsspec.implementations.local import LocalFileOpener, LocalFileSystem


class _SlowOpener(LocalFileOpener):
    def _slow(self):
        if not self.closed and "w" in self.mode:
            time.sleep(float(os.environ.get("UNBROKEN_TEST_WRITE_SECONDS", "1")))

    def close(self):
        self._slow()
        super().close()

    def __exit__(self, *exc):
        self._slow()
        return super().__exit__(*exc)


class SlowFileSystem(LocalFileSystem):
    protocol = "slowfile"

    @classmethod
    def _strip_protocol(cls, path):
        if isinstance(path, str) and path.startswith("slowfile://"):
            path = path[len("slowfile://"):]
        return super()._strip_protocol(path)

    def _open(self, path, mode="rb", **kwargs):
        if "w" in mode:
            self.makedirs(self._parent(path), exist_ok=True)
            return _SlowOpener(path, mode, fs=self, **kwargs)
        return super()._open(path, mode, **kwargs)


fsspec.register_implementation("slowfile", SlowFileSystem, clobber=True)
