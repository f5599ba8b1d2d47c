"""The suite's own harness (tests/conftest.py), where it decides what the tests measure: the port each torchrun job
binds, and the threads the test processes give torch."""

import os
import socket

from conftest import ephemeral_ports, free_port, port_block


def test_a_jobs_port_is_one_that_no_connection_takes():
    """Every torchrun job of the suite binds its rendezvous store on free_port()'s port some time after it was found
    free. An outgoing connection (here one to a listening socket, as gloo's between ranks are) takes its local port
    from the kernel's ephemeral range, so free_port draws below it, and the two xdist workers from separate blocks."""
    with socket.create_server(("127.0.0.1", 0)) as server, socket.create_connection(server.getsockname()) as client:
        assert client.getsockname()[1] in ephemeral_ports()
    drawn = [free_port() for _ in range(50)]
    assert not any(port in ephemeral_ports() for port in drawn), drawn
    assert not set(port_block("gw0")) & set(port_block("gw1"))
    assert max(port_block("gw0")) < ephemeral_ports().start


def test_the_test_processes_run_torch_on_one_thread_as_a_rank_does():
    """torch's operators run on one thread in the test processes, as in each torchrun rank (the suite's jobs are
    started with OMP_NUM_THREADS=1): the one-process references are compared with the ranks, and two workers share
    two cores."""
    import torch

    assert os.environ["OMP_NUM_THREADS"] == "1" and torch.get_num_threads() == 1
