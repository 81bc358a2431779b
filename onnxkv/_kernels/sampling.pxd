# One token drawn from a row of logits (sampling.pyx), shared by cimport with the token loop.
from libc.stdint cimport int64_t

cdef int64_t sample_row_f32(const float *logits, int64_t V, double temperature, int64_t top_k, double top_p,
                            double u, double *p, double *work, int64_t *order) noexcept nogil
