"""The SGLang rollout backend: a client of SGLang HTTP servers, split by concern.

* ``protocol``: the HTTP contract as data (launch command lines, request bodies, response
  parsing), no I/O; contract-tested against SGLang's own schema;
* ``client``: the client's limits (``SGLangClientConfig``) and its one bounded HTTP call;
* ``servers``: server processes and their health (``SGLangServerProcess``, ``ServerPool``:
  live, down, stale, retired; recovery);
* ``generation``: ``SGLangEngine``, the ``RolloutEngine`` with failover that never loses a sample;
* ``weights``: ``SGLangWeights``, the update-group RPCs behind the ``WeightSink`` contract
  (``pipeline.rollout.types``);
* ``backend``: this backend's entry points for the table (``pipeline.rollout.backends``).
"""
