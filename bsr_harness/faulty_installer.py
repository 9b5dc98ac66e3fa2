"""Install faults from outside the runtime: an installer factory that wraps WindowInstaller.

`BoundedRestorer(make_installer=...)` takes any factory with WindowInstaller's signature;
`InstallFault(window).make` is one whose installers raise during the install of one window
(counted by install calls of one restore, so window k at any pipeline depth), in the next
restore only (`once`: a transient fault) or in every restore.
"""

from __future__ import annotations

import torch

from bsr_kernels import WindowInstaller


class InjectedInstallError(RuntimeError):
    """The injected install failure."""


class InstallFault:
    def __init__(self, window: int, once: bool = True, error: type[BaseException] = InjectedInstallError) -> None:
        self.window = window
        self.once = once
        self.error = error
        self.fired = 0

    def make(self, *args, **kwargs) -> _FaultyInstaller:
        return _FaultyInstaller(WindowInstaller(*args, **kwargs), self)


class _FaultyInstaller:
    def __init__(self, inner: WindowInstaller, fault: InstallFault) -> None:
        self.inner = inner
        self.fault = fault
        self.calls = 0

    def install(self, staging: torch.Tensor, first_chunk: int, num_chunks: int) -> str:
        index, self.calls = self.calls, self.calls + 1
        f = self.fault
        if index == f.window and not (f.once and f.fired):
            f.fired += 1
            raise f.error(f"injected exception during the install of window {index}")
        return self.inner.install(staging, first_chunk, num_chunks)
