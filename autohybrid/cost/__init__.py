"""The analytic cost model: compute (FLOPs, bytes), communication (α–β) and memory."""
