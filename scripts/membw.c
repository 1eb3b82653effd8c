/* Memory read bandwidth: a 2 GiB buffer read with AVX2 loads, 5 passes, OpenMP threads.
 * gcc -O2 -mavx2 -fopenmp scripts/membw.c -o membw; OMP_NUM_THREADS=2 ./membw [hp]
 * ("hp": advise the buffer for transparent huge pages). Used in docs/BENCHMARKS.md (issue 11) to
 * say how close decode comes to the memory bound. */
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
int main(int argc,char**argv){ size_t n=(size_t)2<<30; int hp=argc>1;
 char*p=aligned_alloc(2<<20,n); if(hp) madvise(p,n,MADV_HUGEPAGE); memset(p,1,n);
 for(int rep=0;rep<5;rep++){ double t=omp_get_wtime(); volatile int acc=0;
 #pragma omp parallel
 { int th=omp_get_thread_num(), nt=omp_get_num_threads(); size_t c=n/nt; __m256i a=_mm256_setzero_si256();
   for(size_t i=th*c;i<(th+1)*c;i+=128){ a=_mm256_xor_si256(a,_mm256_load_si256((__m256i*)(p+i))); a=_mm256_xor_si256(a,_mm256_load_si256((__m256i*)(p+i+32)));a=_mm256_xor_si256(a,_mm256_load_si256((__m256i*)(p+i+64)));a=_mm256_xor_si256(a,_mm256_load_si256((__m256i*)(p+i+96)));}
   acc+=_mm256_extract_epi32(a,0); }
 t=omp_get_wtime()-t; printf("%s %.1f GB/s %d\n", hp?"thp":"4k", n/t/1e9, acc&1);} }
