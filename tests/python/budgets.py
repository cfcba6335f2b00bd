"""Memory budgets for the tests, found by the planner's own queries
(fused_linear_grpo_plan): no CPU's GEMM scratch, block sizes or tile sizes are
assumed, so the same test plans several chunks on AVX2 and AVX-512 CPUs."""
import fusedgrpo as fg


def least_budget(**call) -> int:
    """The smallest memory_budget the fused call runs with (one-row chunks)."""
    try:
        fg.fused_linear_grpo_plan(**call, memory_budget=1)
    except fg.FusedGRPOError as e:
        assert e.status == "FG_ERR_BUDGET_TOO_SMALL", e
        return e.plan["min_budget_bytes"]
    raise AssertionError("a 1-byte budget was accepted")


def several_chunks_budget(**call) -> int:
    """The smallest budget plus a third of one chunk of every row: the call
    then runs in several chunks. Not a third of the way to the whole call's
    working_bytes: that also holds a GEMM scratchpad per thread, which on a
    CPU with large ones (oneDNN's AVX-512 kernels) or many threads can leave
    room for every row in one chunk."""
    least = least_budget(**call)
    whole = fg.fused_linear_grpo_plan(**call, memory_budget=1 << 40)["chunk_bytes"]
    budget = least + whole // 3
    plan = fg.fused_linear_grpo_plan(**call, memory_budget=budget)
    assert plan["chunks"] > 1, (plan, least, whole)
    return budget
