"""The collective layer: the only part of mc that calls ``torch.distributed`` collectives.

Every other module of mc, in every package, communicates through it, so that each
collective is validated before it is issued, bounded when waited on, recorded
(:func:`mc_groups.record_collectives`), optionally schedule-checked across the ranks, and
named in its errors. Each collective has one issuing function, and every caller (the
public collectives, the traceable ones, coalesced batches,
:class:`~mc_groups.comm.communicator.Communicator`)
reaches it after its own checks. Its public names are exported by :mod:`mc_groups`; the
modules:

==================================  ===========================================================
module                              what it holds
==================================  ===========================================================
:mod:`.collectives`                 the collectives (``all_reduce``, ``reduce_scatter``,
                                    ``all_gather``, ``broadcast``, ``all_to_all``,
                                    ``send``/``recv``, ``barrier``, ``all_gather_objects``,
                                    ``all_reduce_flat``), their one issuing route, gloo's
                                    all-to-all algorithms; and what every collective
                                    shares: ``ReduceOp``, the handle, per-dtype batching
                                    (``by_dtype``), argument checks, descriptions, the
                                    record, torch-version names, the
                                    ``MC_CHECK_COLLECTIVE_SCHEDULE`` switch
:mod:`.traceable`                   the same collectives returning new tensors, traceable by
                                    ``torch.compile(fullgraph=True)``; the op compiled graphs
                                    call before each collective (record, schedule check)
:mod:`.communicator`                batched collectives on one group: ``coalesced`` /
                                    ``CoalescedBatch`` (one kind of collective per batch)
                                    and ``Communicator`` (one caller's lists, bound once
                                    with ``bind``, keeping their temporaries)
:mod:`.recorder`                    ``record_collectives()``: the log of what was issued
:mod:`.cross_rank`                  cross-rank verification, one primitive (``cross_check``),
                                    ``fail_together``, ``CarriedStatus``
==================================  ===========================================================
"""

__all__: list[str] = []
