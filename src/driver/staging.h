/*
 * A request's token arrays on a backend whose memory the host does not
 * read (no FG_BACKEND_HOST_MEMORY): copied to host memory once, so that
 * validation, the loss math and the checks read them where they would on
 * the CPU.
 */
#ifndef FG_STAGING_H
#define FG_STAGING_H

#include "linear_request.h"

typedef struct fg_staged {
    void *mem;          /* the host copies (malloc); NULL: nothing staged */
    fg_batch batch;     /* the request's batch over the copies            */
    fg_tokens tokens;
    linear_request req; /* the request over the copies                    */
} fg_staged;

/* Copies req's token arrays (token ids, mask, advantages, old/ref/sampling
 * log-probs, importance ratios, grad_logp, grad_entropy, and the phase
 * API's stats for fg_linear_shard_backward) to the host and waits. With
 * sizes validation refuses (B or T < 1, B*T*8 bytes overflowing) nothing is
 * staged and out->req is req: validation fails on the sizes before it reads
 * an array. */
fg_status fg_stage_request(fg_call *call, const fg_device *be, const linear_request *req,
                           fg_staged *out);

void fg_staged_free(fg_staged *s);

#endif
