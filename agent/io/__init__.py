"""I/O and transport: everything the agent does off the training thread to be seen and reached.

It owns the I/O thread with its sockets, run file, run log and heartbeats
(:mod:`agent.io.ioloop`), the system and GPU probes it samples (:mod:`agent.io.probes`),
the tcp gateway child process and its front door (:mod:`agent.io.gateway`,
:mod:`agent.io.tcpfront`), a multi-node job's node relay and link
(:mod:`agent.io.relay`, :mod:`agent.io.multinode`), and the start and stop of those child
processes (:mod:`agent.io.helpers`).
"""
