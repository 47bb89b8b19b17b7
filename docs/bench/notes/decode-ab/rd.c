#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <omp.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+1e-9*t.tv_nsec;}
int main(int argc,char**argv){
  long nblk = 700000; /* 12 KB blocks -> 8.6 GB? too much */ nblk = 40000; /* 480 MB */
  long bb = 12288/4; float*a; posix_memalign((void**)&a,64,nblk*bb*4);
  for(long i=0;i<nblk*bb;i++)a[i]=1.0f;
  long*perm=malloc(nblk*8); for(long i=0;i<nblk;i++)perm[i]=i;
  srand(1); for(long i=nblk-1;i>0;i--){long j=rand()%(i+1);long t=perm[i];perm[i]=perm[j];perm[j]=t;}
  int pf = argc>1?atoi(argv[1]):0;
  for(int mode=0;mode<2;mode++) for(int r=0;r<3;r++){
    double t=now(); __m512 s=_mm512_setzero_ps();
    #pragma omp parallel
    {
    __m512 acc=_mm512_setzero_ps();
    #pragma omp for schedule(static)
    for(long b=0;b<nblk;b++){
      const float*p=a+(mode?perm[b]:b)*bb;
      if(pf && b+1<nblk){const char*q=(const char*)(a+(mode?perm[b+1]:b+1)*bb); for(int l=0;l<192;l++)__builtin_prefetch(q+64*l,0,2);}
      for(long i=0;i<bb;i+=16)acc=_mm512_add_ps(acc,_mm512_load_ps(p+i));
    }
    float v=_mm512_reduce_add_ps(acc); if(v==1234.5f)printf("x");
    }
    double dt=now()-t; printf("%s pf=%d %.1f GB/s\n",mode?"shuffled":"sequential",pf,nblk*bb*4/dt/1e9);
  }
}
