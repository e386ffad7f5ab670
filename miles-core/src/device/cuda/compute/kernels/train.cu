// Training kernels: backward passes, attention's head reshapes and causal softmax, the fused
// cross-entropy and AdamW on fp32 master weights. The argument order and C types of each kernel
// are those its wrapper in `train.rs` passes (pointers as 64-bit addresses, `int` for i32,
// `long long` for i64, `float` for f32).
//
// rmsnorm_backward(bf16* dx, float* dw, const bf16* dout, const bf16* x, const bf16* w,
//                  const float* rstd, int c)                                   one block a row
// rope_backward(bf16* dx, const unsigned* positions, const float* cos, const float* sin,
//               long long n, int heads, int d)                                one thread a pair
// swiglu_backward(bf16* dgate, bf16* dup, const bf16* dout, const bf16* gate, const bf16* up,
//                 long long n)                                              one thread a value
// embedding_backward(float* dtable, const bf16* dout, const unsigned* ids, int c)
//                                                                             one block a row
// to_heads(bf16* split, const bf16* rows, int b, int t, int rows_heads, int split_heads, int d)
// from_heads(bf16* rows, const bf16* split, int b, int t, int rows_heads, int split_heads,
//            int d)                                                 grid-stride over outputs
// causal_softmax_forward(bf16* probs, const float* scores, int t)             one block a row
// causal_softmax_backward(bf16* dscores, const bf16* probs, const float* dprobs, int t)
//                                                                             one block a row
// crossentropy(float* logprobs, bf16* dlogits_or_null, const float* logits,
//              const unsigned* targets, const float* weights, int v, float normaliser)
//                                                                             one block a row
// sum_of_squares(float* acc, const float* x, long long n)                   grid-stride, atomics
// adamw_update(float* master, bf16* params, float* m, float* v, const float* grads,
//              long long n, float step_size, float bias2_sqrt, float decay, float beta1,
//              float beta2, float eps, float grad_scale)                      grid-stride
