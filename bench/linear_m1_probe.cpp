// How to read a weight matrix fastest for one row of x (batch-1 decode, float32, AVX2):
// the layouts of loop tried for cpu_kernels_fp32.cpp's linear_m1, over the default model's
// decode-step weight shapes (30 layers x qkv/o/gate_up/down + the 49152-row head, 538 MB,
// on huge pages). Best of 15 each, twice.
//   A<R>      R weight rows interleaved, one FMA chain each (the kernel before linear_m1)
//   B<U>      one weight row at a time in storage order, U FMA chains along K (linear_m1)
//   C<R, PD>  A with a software prefetch PD bytes ahead in each row
//   D<U, PD>  B with a software prefetch PD bytes ahead
// Build and run:
//   g++ -O3 -march=x86-64-v3 -fopenmp bench/linear_m1_probe.cpp -o /tmp/m1 && OMP_NUM_THREADS=2 /tmp/m1
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <chrono>
#include <vector>
#include <algorithm>
typedef __m256 F;
static inline float hsum(F v){ __m128 a=_mm_add_ps(_mm256_castps256_ps128(v),_mm256_extractf128_ps(v,1)); a=_mm_hadd_ps(a,a); a=_mm_hadd_ps(a,a); return _mm_cvtss_f32(a);}
// A: R rows interleaved, 1 acc each
template<int R> void varA(const float*x,const float*w,float*y,long N,long K){
  long G=N/R;
#pragma omp parallel for schedule(static)
  for(long g=0;g<G;g++){ const float* wg=w+g*R*K; F acc[R]; for(int r=0;r<R;r++)acc[r]=_mm256_setzero_ps();
    for(long k=0;k<K;k+=8){ F xv=_mm256_loadu_ps(x+k); for(int r=0;r<R;r++) acc[r]=_mm256_fmadd_ps(_mm256_loadu_ps(wg+r*K+k),xv,acc[r]); }
    for(int r=0;r<R;r++) y[g*R+r]=hsum(acc[r]); }
}
// B: one row at a time, U accumulators along k (sequential)
template<int U> void varB(const float*x,const float*w,float*y,long N,long K){
#pragma omp parallel for schedule(static)
  for(long n=0;n<N;n++){ const float* wr=w+n*K; F acc[U]; for(int u=0;u<U;u++)acc[u]=_mm256_setzero_ps();
    long k=0; for(;k+8*U<=K;k+=8*U) for(int u=0;u<U;u++) acc[u]=_mm256_fmadd_ps(_mm256_loadu_ps(wr+k+8*u),_mm256_loadu_ps(x+k+8*u),acc[u]);
    for(;k<K;k+=8) acc[0]=_mm256_fmadd_ps(_mm256_loadu_ps(wr+k),_mm256_loadu_ps(x+k),acc[0]);
    for(int u=1;u<U;u++) acc[0]=_mm256_add_ps(acc[0],acc[u]); y[n]=hsum(acc[0]); }
}
// C: R rows interleaved + prefetch PD bytes ahead in linear address
template<int R,int PD> void varC(const float*x,const float*w,float*y,long N,long K){
  long G=N/R;
#pragma omp parallel for schedule(static)
  for(long g=0;g<G;g++){ const float* wg=w+g*R*K; F acc[R]; for(int r=0;r<R;r++)acc[r]=_mm256_setzero_ps();
    for(long k=0;k<K;k+=8){ F xv=_mm256_loadu_ps(x+k); for(int r=0;r<R;r++){ if((k&15)==0) _mm_prefetch((const char*)(wg+r*K+k)+PD,_MM_HINT_T0); acc[r]=_mm256_fmadd_ps(_mm256_loadu_ps(wg+r*K+k),xv,acc[r]);} }
    for(int r=0;r<R;r++) y[g*R+r]=hsum(acc[r]); }
}
// D: one row, U accs, sequential prefetch PD ahead
template<int U,int PD> void varD(const float*x,const float*w,float*y,long N,long K){
#pragma omp parallel for schedule(static)
  for(long n=0;n<N;n++){ const float* wr=w+n*K; F acc[U]; for(int u=0;u<U;u++)acc[u]=_mm256_setzero_ps();
    for(long k=0;k<K;k+=8*U){ _mm_prefetch((const char*)(wr+k)+PD,_MM_HINT_T0); if(U>=2) _mm_prefetch((const char*)(wr+k)+PD+64,_MM_HINT_T0); for(int u=0;u<U;u++) acc[u]=_mm256_fmadd_ps(_mm256_loadu_ps(wr+k+8*u),_mm256_loadu_ps(x+k+8*u),acc[u]);}
    for(int u=1;u<U;u++) acc[0]=_mm256_add_ps(acc[0],acc[u]); y[n]=hsum(acc[0]); }
}
struct Lin{long N,K; float* w;};
float* halloc(size_t bytes){ void* p=mmap(0,bytes,PROT_READ|PROT_WRITE,MAP_PRIVATE|MAP_ANONYMOUS,-1,0); madvise(p,bytes,MADV_HUGEPAGE); memset(p,1,bytes); return (float*)p;}
int main(){
  std::vector<Lin> ls; long H=576,I=1536;
  for(int l=0;l<30;l++){ ls.push_back({960,H,0}); ls.push_back({576,H,0}); ls.push_back({2*I,H,0}); ls.push_back({H,I,0}); }
  ls.push_back({49152,H,0});
  size_t tot=0; for(auto&L:ls){ L.w=halloc(L.N*L.K*4); for(long i=0;i<L.N*L.K;i++) L.w[i]=(i%7)*0.01f; tot+=L.N*L.K*4;}
  float* x=halloc(1<<16); for(int i=0;i<1536;i++)x[i]=0.5f; float* y=halloc(49152*4);
  auto run=[&](const char* name, void(*f)(const float*,const float*,float*,long,long)){
    double best=1e9; for(int rep=0;rep<15;rep++){ auto t0=std::chrono::steady_clock::now(); for(auto&L:ls) f(x,L.w,y,L.N,L.K); double t=std::chrono::duration<double>(std::chrono::steady_clock::now()-t0).count(); best=std::min(best,t);} 
    printf("%-14s %.2f ms  %.1f GB/s\n",name,best*1e3,tot/best/1e9); };
  for(int round=0;round<2;round++){
  run("A8",varA<8>); run("A4",varA<4>); run("A16",varA<16>);
  run("B1",varB<1>); run("B4",varB<4>); run("B8",varB<8>);
  run("C8pf512",varC<8,512>); run("C8pf1024",varC<8,1024>); run("C4pf1024",varC<4,1024>);
  run("D4pf1024",varD<4,1024>); run("D4pf2048",varD<4,2048>); run("D8pf2048",varD<8,2048>);
  }
}
