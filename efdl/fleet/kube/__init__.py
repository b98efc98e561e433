"""The fleet on Kubernetes (docs/kubernetes.md, "The fleet"): a controller that makes the
cluster keep the fleet's rules. The fleet's records stay in etcd (``efdl submit``, ``efdl
jobs``, ``efdl cancel`` work as on hosts); the controller is the allocator and every GPU
node's ``efdl node`` at once:

- :mod:`.api`: the few calls it makes to the API server (an interface), its errors;
- :mod:`.cluster`: pure: the cluster read as the allocator's host records, a job's pods that
  ended as its end;
- :mod:`.pods`: pure: the allocator's statuses as pods to create and delete;
- :mod:`.client`: that interface on the official ``kubernetes`` client (a timeout on every
  call, errors that name the object);
- :mod:`.controller`: the elected loop: read, decide, act, once per interval.
"""
