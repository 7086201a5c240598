"""The collective layer: the only part of mc that calls ``torch.distributed`` collectives.

Every other module of mc, in every package, communicates through it, so that each
collective is validated before it is issued, bounded when waited on, recorded
(:func:`mc_groups.record_collectives`), optionally schedule-checked across the ranks, and
named in its errors. Its public names are exported by :mod:`mc_groups`; the modules:

==================================  ===========================================================
module                              what it holds
==================================  ===========================================================
:mod:`.collectives`                 the collectives (``all_reduce``, ``reduce_scatter``,
                                    ``all_gather``, ``broadcast``, ``all_to_all``,
                                    ``send``/``recv``, ``barrier``, ``all_gather_objects``,
                                    ``coalesced``, ``all_reduce_flat``) and group queries
:mod:`.traceable`                   the same collectives returning new tensors, traceable by
                                    ``torch.compile(fullgraph=True)``
:mod:`.communicator`                ``Communicator``: one caller's batched collectives on one
                                    group, keeping their temporaries
:mod:`.recorder`                    ``record_collectives()``: the log of what was issued
:mod:`.cross_rank`                  cross-rank verification, one primitive (``cross_check``):
                                    ``fail_together``, ``CarriedStatus``, the per-collective
                                    check behind ``MC_CHECK_COLLECTIVE_SCHEDULE``
``_common``                         what every collective shares: ``ReduceOp``, the handle,
                                    checks, descriptions, recording, issuing, per-dtype
                                    batching (``by_dtype``)
``_coalesced``                      coalesced batches (one kind of collective per batch)
``_reduce_scatter``                 the reduce-scatter algorithms (all-to-all + local sum)
``_gloo``                           gloo's all-gather (point to point or all-to-all)
``_p2p_all_gather``                 an all-gather made of point-to-point sends on a tag
``_compiled``                       the custom op ``mc_groups::collective`` compiled graphs
                                    call before each collective
``_shims``                          torch-version names
==================================  ===========================================================
"""

__all__: list[str] = []
