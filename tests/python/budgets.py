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
    """A budget a third of the way from the smallest to what one chunk of every
    row needs: the call then runs in several chunks of several rows."""
    least = least_budget(**call)
    whole = fg.fused_linear_grpo_plan(**call, memory_budget=1 << 40)["working_bytes"]
    budget = least + (whole - least) // 3
    plan = fg.fused_linear_grpo_plan(**call, memory_budget=budget)
    assert plan["chunks"] > 1, (plan, least, whole)
    return budget
