// Weights a kernel copies at load (repacked blocks) in 2 MiB pages: a decode step streams every
// weight once, and through 4 KiB pages (a TLB miss per page) it streamed ~20% slower here. Tensors
// are carved one after another out of 2 MiB-aligned regions that ask for transparent huge pages,
// so small matrices share pages instead of each rounding up; a region is unmapped with the last
// tensor in it. Pages are touched only where written: a region's unused tail costs at most the
// huge page it begins in.
#include <torch/extension.h>
#include <sys/mman.h>
#include <memory>
#include <mutex>

namespace {

constexpr size_t HUGE_PAGE = size_t(2) << 20;
constexpr size_t REGION = size_t(64) << 20;  // reserved at a time (address space, not memory)
constexpr size_t ALIGN = 64;

struct Region {
  void* base = nullptr;
  size_t len = 0, used = 0;
  Region(size_t want) {
    len = (want + HUGE_PAGE - 1) / HUGE_PAGE * HUGE_PAGE;
    // Reserve a huge page more than needed, then unmap the slack on both sides of the aligned start.
    void* raw = mmap(nullptr, len + HUGE_PAGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    TORCH_CHECK(raw != MAP_FAILED, "huge_page_zeros: cannot map ", len, " bytes");
    const auto at = reinterpret_cast<uintptr_t>(raw);
    const uintptr_t start = (at + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1);
    if (start > at) munmap(raw, start - at);
    munmap(reinterpret_cast<void*>(start + len), at + HUGE_PAGE - start);
    base = reinterpret_cast<void*>(start);
#ifdef MADV_HUGEPAGE
    madvise(base, len, MADV_HUGEPAGE);  // advice only: a kernel without THP keeps small pages
#endif
  }
  ~Region() { munmap(base, len); }
};

std::mutex lock;
std::weak_ptr<Region> current;  // the region new tensors go to while any tensor keeps it alive

}  // namespace

// Zeros (anonymous pages read as zero until written) of `sizes` in 2 MiB pages.
torch::Tensor huge_page_zeros(at::IntArrayRef sizes, at::ScalarType dtype) {
  int64_t numel = 1;
  for (const auto s : sizes) numel *= s;
  const size_t bytes = (size_t(numel) * c10::elementSize(dtype) + ALIGN - 1) / ALIGN * ALIGN;
  std::shared_ptr<Region> region;
  size_t offset;
  {
    std::lock_guard<std::mutex> guard(lock);
    region = current.lock();
    if (!region || region->len - region->used < bytes) {
      region = std::make_shared<Region>(std::max(bytes, REGION));
      current = region;
    }
    offset = region->used;
    region->used += bytes;
  }
  void* p = static_cast<char*>(region->base) + offset;
  return torch::from_blob(p, sizes, [region](void*) {}, torch::dtype(dtype));
}
