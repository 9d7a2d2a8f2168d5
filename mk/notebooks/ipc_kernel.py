"""The Jupyter kernel the runner starts for `transport="ipc"`: ipykernel, opening no TCP socket.

    python -m mk.notebooks.ipc_kernel -f CONNECTION_FILE

The connection file's transport makes ipykernel's five channels unix sockets, but ipykernel still
opens two TCP sockets of its own: the IOPub pipe that forwards forked subprocesses' output
(`IOPubThread._setup_pipe_in`, on 127.0.0.1) and the debugpy bridge. Where no TCP socket can be
made at all (the lent TPU v5e VM: `socket(AF_INET)` fails), libzmq aborts the kernel on the first
("Address family not supported by protocol (src/ip_resolver.cpp:542)") before it replies to
`kernel_info`. Here both are off: output of forked subprocesses is not forwarded (the notebooks
fork none), and the kernel has no debugger. Everything else is ipykernel's own launcher.
"""
from __future__ import annotations


def _no_fork_pipe(self):
    """`IOPubThread._setup_pipe_in` without the TCP pipe: forked children's output is dropped."""
    self._pipe_flag = False


def main():
    from ipykernel import debugger, iostream, kernelapp
    iostream.IOPubThread._setup_pipe_in = _no_fork_pipe
    debugger._is_debugpy_available = False
    kernelapp.launch_new_instance()


if __name__ == "__main__":
    main()
