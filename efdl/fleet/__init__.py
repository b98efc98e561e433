"""The fleet: many elastic jobs sharing one pool of GPU hosts by priority (docs/fleet.md).

- ``model``: the records in etcd (hosts, job specs, job statuses) and their codecs;
- ``allocate``: the one decision, pure: GPUs and jobs in, each job's GPUs and the reasons out.
"""
