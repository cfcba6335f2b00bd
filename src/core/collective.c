/* Agreement among the shards of a collective call (see collective.h). */
#include <string.h>

#include "collective.h"

void fg_hash_init(fg_call_hash *k) { k->h = 14695981039346656037ull; }

void fg_hash_i64(fg_call_hash *k, int64_t v)
{
    uint64_t u = (uint64_t)v;
    for (int b = 0; b < 8; b++, u >>= 8) {
        k->h ^= u & 0xff;
        k->h *= 1099511628211ull;
    }
}

void fg_hash_f64(fg_call_hash *k, double v)
{
    int64_t bits;
    memcpy(&bits, &v, sizeof bits);
    fg_hash_i64(k, bits);
}

/* Status codes and hash pieces travel as small integers in floats: exact. */
#define HASH_PIECES 4

static int reduce(fg_call *call, float *buf, int64_t count, fg_reduce_op op)
{
    return call->comm.allreduce(call->comm.user, buf, count, op);
}

static fg_status peer_failed(fg_call *call, fg_status local, fg_status all)
{
    if (all == local) /* this shard's own failure keeps its message */
        return all;
    return fg_fail(call->err, all,
                   "another vocab shard of this collective call failed with %s; every shard "
                   "returns it (that shard's message says why)",
                   fg_status_name(all));
}

fg_status fg_collective_agree(fg_call *call, fg_status local, fg_call_hash hash,
                              int64_t *chunk_rows)
{
    /* MAX of [status, -chunk rows, hash pieces, -hash pieces]: the maxima and
     * minima of each; the hashes agree when every piece's max is its min. */
    float buf[2 + 2 * HASH_PIECES];
    buf[0] = (float)local;
    buf[1] = -(float)(local == FG_OK ? *chunk_rows : 0);
    uint64_t h = hash.h;
    for (int k = 0; k < HASH_PIECES; k++, h >>= 16) {
        buf[2 + k] = (float)(h & 0xffff);
        buf[2 + HASH_PIECES + k] = -(float)(h & 0xffff);
    }
    if (reduce(call, buf, 2 + 2 * HASH_PIECES, FG_REDUCE_MAX) != 0)
        return fg_fail(call->err, FG_ERR_COMMUNICATOR,
                       "the communicator's allreduce failed (entry agreement)");
    const fg_status all = (fg_status)(int)buf[0];
    if (all != FG_OK)
        return peer_failed(call, local, all);
    for (int k = 0; k < HASH_PIECES; k++)
        if (buf[2 + k] != -buf[2 + HASH_PIECES + k])
            return fg_fail(call->err, FG_ERR_COMMUNICATOR,
                           "the vocab shards of a collective call disagree on it: shapes (B, T, "
                           "H, vocab_total), mask, token ids, dtypes, loss config, temperature, "
                           "options or the outputs asked for differ between shards");
    *chunk_rows = (int64_t)-buf[1];
    return FG_OK;
}

fg_status fg_collective_ready(fg_call *call, fg_status local)
{
    float s = (float)local;
    if (reduce(call, &s, 1, FG_REDUCE_MAX) != 0)
        return fg_fail(call->err, FG_ERR_COMMUNICATOR,
                       "the communicator's allreduce failed (entry agreement)");
    return (fg_status)(int)s == FG_OK ? FG_OK : peer_failed(call, local, (fg_status)(int)s);
}

int fg_collective_reduce(fg_call *call, float *buf, int64_t count, fg_reduce_op op, int failed)
{
    buf[count] = failed ? 1.0f : 0.0f; /* >= 0 on every shard: MAX or SUM, nonzero iff any */
    if (reduce(call, buf, count + 1, op) != 0)
        return -1;
    return buf[count] != 0.0f;
}

fg_status fg_collective_outcome(fg_call *call, fg_status local)
{
    float s = (float)local;
    if (reduce(call, &s, 1, FG_REDUCE_MAX) != 0)
        return local != FG_OK ? local
                              : fg_fail(call->err, FG_ERR_COMMUNICATOR,
                                        "the communicator's allreduce failed (exit agreement)");
    return (fg_status)(int)s == FG_OK ? FG_OK : peer_failed(call, local, (fg_status)(int)s);
}
