"""The takeover agent that the initializer uploads to machines, one module an idea.

Standard library only, every module (the target may have nothing but
``python3``), and nothing imported from above this package: it is uploaded
as one zipapp built from these files (`shepherd.agent_bundle`), whose
``__main__`` is this package's `__main__`.

- `wire`: the protobuf codec of the agent's messages;
- `protocol`: what agent and server agree on beyond the messages (path,
  headers, the signed bytes), imported by the server too;
- `ed25519`: key derivation and signing;
- `keyfile`: the private seed beside the agent;
- `hwreport`: the hardware report from /proc and /sys;
- `heartbeat`: the heartbeat client;
- `install`: installing the node as a heartbeat's answer asks;
- `download`: the image download, bounded, resumed and verified;
- `disks`: the loopback folders that stand for disks;
- `daemon`: detaching, the pid file, log lines;
- `files`, `errors`: small reads, the agent's error.
"""
