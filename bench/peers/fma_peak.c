/* The machine's float32 FMA peak: independent AVX2 FMA chains on every OpenMP thread, best of 5.
 *
 *     gcc -O2 -mavx2 -mfma -fopenmp bench/peers/fma_peak.c -o /tmp/fma_peak && OMP_NUM_THREADS=2 /tmp/fma_peak
 *
 * Where it sits: the roof against which bench/results/native_packed.txt reads the GEMMs' GFLOP/s
 * (bench/peers/peers.py's roof is torch.mm's, which on an AMD EPYC is MKL's generic path, 62% of this).
 * 12 chains of 8 floats per thread keep both FMA pipes busy past their 4-5 cycle latency. */
#include <immintrin.h>
#include <stdio.h>
#include <omp.h>
int main(){
  long iters=400000000L/4;
  double best=0;
  for(int rep=0;rep<5;rep++){
  double t0=omp_get_wtime();
  float out=0;
  #pragma omp parallel reduction(+:out)
  {
    __m256 a[12]; __m256 b=_mm256_set1_ps(1.0000001f), c=_mm256_set1_ps(1e-7f);
    for(int i=0;i<12;i++) a[i]=_mm256_set1_ps((float)i);
    for(long it=0;it<iters;it++){
      #pragma GCC unroll 12
      for(int i=0;i<12;i++) a[i]=_mm256_fmadd_ps(a[i],b,c);
    }
    __m256 s=a[0]; for(int i=1;i<12;i++) s=_mm256_add_ps(s,a[i]);
    float t[8]; _mm256_storeu_ps(t,s); out+=t[0];
  }
  double dt=omp_get_wtime()-t0;
  double gf=(double)iters*12*8*2*omp_get_max_threads()/dt/1e9;
  if(gf>best)best=gf;
  printf("threads %d: %.1f GFLOP/s (%.3f s) %g\n",omp_get_max_threads(),gf,dt,out);
  }
  printf("best %.1f\n",best);
}
