/* A persistent pool of worker threads for the CPU kernels of this directory (one library:
 * kernels/cpu_lib.py builds every .c file here into it).
 *
 * pool_run(task, ctx, threads, spin) calls task(ctx, id, threads) once for each id in
 * [0, threads): id 0 on the calling thread, the others on pool threads, and returns when all
 * have returned. Calls from several threads at once are serialised.
 *
 * After a job a pool thread sleeps on a condition variable (an idle worker costs no CPU), or,
 * when the job asked for it (spin != 0), first spins for the spin budget (pool_set_spin_us,
 * default 1 ms). Waking a sleeping thread costs up to half a millisecond on a virtual machine
 * (its idle vCPU halts), more than a whole layer of a one-sequence decode step, whose kernels
 * come tens to hundreds of microseconds apart: small steps ask for the spin and keep their
 * threads awake through the step; large ones, whose kernels are long and whose GEMMs run on
 * torch's OpenMP threads, do not, so no spinning thread holds a core those want. */
#ifndef PAGODA_THREAD_POOL_H
#define PAGODA_THREAD_POOL_H

#include <stdint.h>

typedef void (*pool_task)(void *ctx, int id, int threads);

void pool_run(pool_task task, void *ctx, int threads, int spin);

/* Whether a pool thread is asleep now (a hint, read without the lock): a job too small to pay
 * for waking it (tens of microseconds of work against up to half a millisecond to wake) is
 * better run on the calling thread alone. */
int pool_asleep(void);

/* How many jobs so far had to wake a sleeping pool thread. */
int64_t pool_wakeups(void);

/* Spin after every job, whatever it asks (kernels/cpu_lib.py's set_spin_always): when a large
 * step's GEMMs run on this pool too, its kernels also come back to back. */
void pool_set_spin_always(int on);

#endif
