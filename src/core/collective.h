/*
 * The one-call hook's side of a collective call (fg_communicator): how the
 * shards of one fg_linear_* call agree with each other so that none of them
 * waits in a reduction the others will never join.
 *
 *   fg_collective_agree   entry: every shard's status after its checks, a hash
 *                         of what the call is, and the chunk size (the smallest)
 *   fg_collective_ready   entry, after the agreed plan's memory is in hand
 *   fg_collective_reduce  a reduction of the call's sequence; the buffer's
 *                         last float is a failure flag
 *   fg_collective_outcome exit: every shard returns the same status
 *
 * The drivers call them in the same order on every shard. A shard that fails
 * between two reductions skips its work up to the next one and raises the
 * flag there: every shard sees it in the same reduction, stops, and the
 * outcome agrees on the status.
 */
#ifndef FG_COLLECTIVE_H
#define FG_COLLECTIVE_H

#include "call.h"

/* FNV-1a over the values that make a call: shards must agree on all of them. */
typedef struct fg_call_hash {
    uint64_t h;
} fg_call_hash;

void fg_hash_init(fg_call_hash *k);
void fg_hash_i64(fg_call_hash *k, int64_t v);
void fg_hash_f64(fg_call_hash *k, double v);

/* `local`: this shard's status so far (its message is in call->err). *chunk_rows
 * in: this shard's chunk size; out: the smallest of all shards. Returns the
 * largest status of all shards (with this shard's own message when it is
 * its own), FG_ERR_COMMUNICATOR if the hashes differ or the reduction fails. */
fg_status fg_collective_agree(fg_call *call, fg_status local, fg_call_hash hash,
                              int64_t *chunk_rows);

/* The second entry reduction: the agreed plan reserved (or not) on every shard. */
fg_status fg_collective_ready(fg_call *call, fg_status local);

/* Reduces buf[0, count) in place, buf[count] being the flag slot (set here
 * from `failed`): 0 when no shard failed, 1 when some shard raised its flag,
 * -1 when the communicator failed. */
int fg_collective_reduce(fg_call *call, float *buf, int64_t count, fg_reduce_op op, int failed);

/* Exit: the largest status of all shards; a shard that did not fail itself
 * gets a message naming the status. */
fg_status fg_collective_outcome(fg_call *call, fg_status local);

#endif
