/*
 * The LM-head entry points on a context whose backend sits behind the
 * per-chunk seam (backend.h): linear_grpo.c hands a request here when its
 * call has a device (fg_call.device). linear_device.c describes the flow.
 */
#ifndef FG_LINEAR_DEVICE_H
#define FG_LINEAR_DEVICE_H

#include "linear_request.h"

/* fg_linear_grpo, fg_linear_logprobs, fg_linear_logprobs_backward. */
fg_status fg_linear_device_execute(fg_call *call, const fg_linear_options *opts,
                                   const linear_request *req, const fg_linear_inputs *in,
                                   fg_linear_outputs *out);

/* fg_linear_grpo_plan: the backend memory the call holds (working_bytes is
 * its workspace). */
fg_status fg_linear_device_plan(fg_call *call, const fg_linear_options *opts,
                                const linear_request *req, const fg_linear_inputs *in,
                                const fg_linear_outputs *out, fg_linear_plan_info *info);

#endif
