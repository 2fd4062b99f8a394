"""Scale-out: ranks in lockstep (:mod:`.lockstep`: tensor parallelism, ``synced_gpus``) and device
maps that leave room for the KV cache and the draft views (:mod:`.device_map`)."""
