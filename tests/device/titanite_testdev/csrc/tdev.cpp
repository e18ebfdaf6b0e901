// titanite's test device: an out-of-tree PrivateUse1 backend, registered the way a vendor's
// extension registers its device (allocator, device guard, generators, hooks, autocast policy),
// with every compute op running through PyTorch's boxed CPU fallback. Its memory is host memory
// from its own allocator; nothing in titanite may rely on that.
//
// Knobs, read once when the library loads (tests set them per process):
//   TITANITE_TESTDEV_COUNT   number of devices (default 4; 0 = the device is not available)
//   TITANITE_TESTDEV_PINNED  0 = no pinned host memory (pinning gives plain host memory), default 1

#include <torch/extension.h>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/EmptyTensor.h>
#include <ATen/autocast_mode.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <ATen/native/CPUFallback.h>
#include <ATen/native/Resize.h>
#include <ATen/ops/as_strided_cpu_dispatch.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/set_native.h>
#include <ATen/ops/view_native.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/unfold_native.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/alloc_cpu.h>
#include <torch/csrc/Generator.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <unordered_map>
#include <unordered_set>

namespace tdev {

constexpr c10::DeviceType kType = c10::DeviceType::PrivateUse1;
constexpr int kMaxDevices = 16;

int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::atoi(v) : fallback;
}

c10::DeviceIndex device_count() {
  static const int n = std::min(std::max(env_int("TITANITE_TESTDEV_COUNT", 4), 0), kMaxDevices);
  return static_cast<c10::DeviceIndex>(n);
}

bool pinned_supported() {
  static const bool yes = env_int("TITANITE_TESTDEV_PINNED", 1) != 0;
  return yes;
}

thread_local c10::DeviceIndex current_index = 0;

void check_index(c10::DeviceIndex index) {
  TORCH_CHECK(index >= 0 && index < device_count(), "tdev: device index ", static_cast<int>(index),
              " is out of range: this process has ", static_cast<int>(device_count()), " tdev devices");
}

// ---- memory: its own allocator; each allocation remembers the device it was made for ----------

std::mutex owners_mutex;
std::unordered_map<void*, c10::DeviceIndex> owners;

void free_device_memory(void* ptr) {
  {
    std::lock_guard<std::mutex> lock(owners_mutex);
    owners.erase(ptr);
  }
  c10::free_cpu(ptr);
}

struct DeviceAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t nbytes) override {
    c10::DeviceIndex index = current_index;
    void* ptr = nbytes ? c10::alloc_cpu(nbytes) : nullptr;
    if (ptr) {
      std::lock_guard<std::mutex> lock(owners_mutex);
      owners[ptr] = index;
    }
    return {ptr, ptr, &free_device_memory, c10::Device(kType, index)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &free_device_memory; }
  void copy_data(void* dest, const void* src, std::size_t count) const override { std::memcpy(dest, src, count); }
};

DeviceAllocator device_allocator;
REGISTER_ALLOCATOR(kType, &device_allocator);

// Pinned host memory: CPU memory that the hooks can recognise as pinned.
std::mutex pinned_mutex;
std::unordered_set<const void*> pinned;

void free_pinned(void* ptr) {
  {
    std::lock_guard<std::mutex> lock(pinned_mutex);
    pinned.erase(ptr);
  }
  c10::free_cpu(ptr);
}

struct PinnedAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t nbytes) override {
    void* ptr = nbytes ? c10::alloc_cpu(nbytes) : nullptr;
    if (ptr) {
      std::lock_guard<std::mutex> lock(pinned_mutex);
      pinned.insert(ptr);
    }
    return {ptr, ptr, &free_pinned, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &free_pinned; }
  void copy_data(void* dest, const void* src, std::size_t count) const override { std::memcpy(dest, src, count); }
};

PinnedAllocator pinned_allocator;

// ---- device guard: current device, streams (ids only: work runs synchronously), events -------

thread_local std::array<c10::StreamId, kMaxDevices> current_streams{};
std::atomic<c10::StreamId> next_stream_id{1};

struct Event {
  std::chrono::steady_clock::time_point when;
};

struct Guard final : c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return kType; }
  c10::Device exchangeDevice(c10::Device d) const override {
    c10::Device old = getDevice();
    if (d.index() != old.index()) setDevice(d);
    return old;
  }
  c10::Device getDevice() const override { return {kType, current_index}; }
  void setDevice(c10::Device d) const override {
    TORCH_CHECK(d.type() == kType, "tdev: not a tdev device: ", d);
    check_index(d.index());
    current_index = d.index();
  }
  void uncheckedSetDevice(c10::Device d) const noexcept override { current_index = d.index(); }
  c10::Stream getStream(c10::Device d) const override {
    return c10::Stream(c10::Stream::UNSAFE, d, current_streams[d.index()]);
  }
  c10::Stream getDefaultStream(c10::Device d) const override { return c10::Stream(c10::Stream::DEFAULT, d); }
  c10::Stream getStreamFromGlobalPool(c10::Device d, bool /*high_priority*/) const override {
    return c10::Stream(c10::Stream::UNSAFE, d, next_stream_id++);
  }
  c10::Stream getNewStream(c10::Device d, int /*priority*/) const override {
    return c10::Stream(c10::Stream::UNSAFE, d, next_stream_id++);
  }
  c10::Stream exchangeStream(c10::Stream s) const override {
    c10::Stream old = getStream(s.device());
    current_streams[s.device_index()] = s.id();
    return old;
  }
  c10::DeviceIndex deviceCount() const noexcept override { return device_count(); }
  void record(void** event, const c10::Stream& /*stream*/, const c10::DeviceIndex /*index*/,
              const c10::EventFlag /*flag*/) const override {
    if (*event == nullptr) *event = new Event();
    static_cast<Event*>(*event)->when = std::chrono::steady_clock::now();
  }
  void block(void* /*event*/, const c10::Stream& /*stream*/) const override {}
  bool queryEvent(void* /*event*/) const override { return true; }
  void destroyEvent(void* event, const c10::DeviceIndex /*index*/) const noexcept override {
    delete static_cast<Event*>(event);
  }
  bool queryStream(const c10::Stream& /*stream*/) const override { return true; }
  void synchronizeStream(const c10::Stream& /*stream*/) const override {}
  void synchronizeEvent(void* /*event*/) const override {}
  void synchronizeDevice(const c10::DeviceIndex /*index*/) const override {}
  double elapsedTime(void* start, void* end, const c10::DeviceIndex /*index*/) const override {
    TORCH_CHECK(start && end, "tdev: both events must be recorded before elapsed_time");
    auto d = static_cast<Event*>(end)->when - static_cast<Event*>(start)->when;
    return std::chrono::duration<double, std::milli>(d).count();
  }
};

C10_REGISTER_GUARD_IMPL(PrivateUse1, Guard);

// ---- generators: each device's own state. Random ops run on the CPU kernels through the
// fallback, which hands them this generator's inner CPU generator (see fallback below). ------

struct Generator final : c10::GeneratorImpl {
  explicit Generator(c10::DeviceIndex index)
      : c10::GeneratorImpl(c10::Device(kType, index), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1)),
        cpu(at::make_generator<at::CPUGeneratorImpl>(c10::default_rng_seed_val)) {}
  static c10::DeviceType device_type() { return kType; }
  void set_current_seed(uint64_t seed) override { cpu.set_current_seed(seed); }
  void set_offset(uint64_t offset) override { cpu.set_offset(offset); }
  uint64_t get_offset() const override { return cpu.get_offset(); }
  uint64_t current_seed() const override { return cpu.current_seed(); }
  uint64_t seed() override { return cpu.seed(); }
  void set_state(const c10::TensorImpl& state) override { cpu.unsafeGetGeneratorImpl()->set_state(state); }
  c10::intrusive_ptr<c10::TensorImpl> get_state() const override {
    return cpu.unsafeGetGeneratorImpl()->get_state();
  }
  Generator* clone_impl() const override {
    auto* copy = new Generator(device().index());
    copy->cpu = cpu.clone();
    return copy;
  }
  at::Generator cpu;
};

const at::Generator& default_generator(c10::DeviceIndex index) {
  static std::once_flag once;
  static std::vector<at::Generator> generators;
  std::call_once(once, [] {
    for (c10::DeviceIndex i = 0; i < device_count(); ++i) {
      generators.push_back(at::make_generator<Generator>(i));
      generators.back().seed();
    }
  });
  if (index < 0) index = current_index;
  check_index(index);
  return generators[index];
}

at::Generator new_generator(c10::DeviceIndex index) {
  return at::make_generator<Generator>(index < 0 ? current_index : index);
}

// ---- hooks: what PyTorch asks of an accelerator ----------------------------------------------

struct Hooks final : at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return device_count() > 0; }
  const at::Generator& getDefaultGenerator(c10::DeviceIndex index) const override { return default_generator(index); }
  at::Generator getNewGenerator(c10::DeviceIndex index) const override { return new_generator(index); }
  at::Device getDeviceFromPtr(void* data) const override {
    std::lock_guard<std::mutex> lock(owners_mutex);
    auto it = owners.find(data);
    TORCH_CHECK(it != owners.end(), "tdev: pointer ", data, " was not allocated by the tdev allocator");
    return {kType, it->second};
  }
  bool isPinnedPtr(const void* data) const override {
    std::lock_guard<std::mutex> lock(pinned_mutex);
    return pinned.count(data) > 0;
  }
  // Without pinned memory, "pinned" allocations are plain host memory that is_pinned() denies:
  // PyTorch itself asks a PrivateUse1 backend for this allocator (a non-blocking copy to the
  // CPU allocates its destination with it), so a backend must answer even when it cannot pin.
  at::Allocator* getPinnedMemoryAllocator() const override {
    return pinned_supported() ? static_cast<at::Allocator*>(&pinned_allocator) : c10::GetCPUAllocator();
  }
  bool hasPrimaryContext(c10::DeviceIndex /*index*/) const override { return true; }
  c10::DeviceIndex deviceCount() const override { return device_count(); }
  void setCurrentDevice(c10::DeviceIndex index) const override {
    check_index(index);
    current_index = index;
  }
  c10::DeviceIndex getCurrentDevice() const override { return current_index; }
  c10::DeviceIndex exchangeDevice(c10::DeviceIndex index) const override {
    auto old = current_index;
    setCurrentDevice(index);
    return old;
  }
  c10::DeviceIndex maybeExchangeDevice(c10::DeviceIndex index) const override { return exchangeDevice(index); }
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t nbytes) const override {
    c10::StorageImpl* impl = storage.unsafeGetStorageImpl();
    TORCH_CHECK(impl->resizable(), "tdev: trying to resize storage that is not resizable");
    c10::DataPtr fresh = device_allocator.allocate(nbytes);
    size_t keep = std::min(nbytes, impl->nbytes());
    if (keep) std::memcpy(fresh.get(), impl->data(), keep);
    impl->set_data_ptr_noswap(std::move(fresh));
    impl->set_nbytes(nbytes);
  }
};

Hooks hooks;
struct HooksRegistration {
  HooksRegistration() { at::RegisterPrivateUse1HooksInterface(&hooks); }
} hooks_registration;

// ---- the few kernels a backend must own (memory and views); the rest is the CPU fallback ----

c10::DispatchKeySet key_set() { return c10::DispatchKeySet(c10::DispatchKey::PrivateUse1); }

at::Tensor empty(c10::IntArrayRef size, std::optional<at::ScalarType> dtype, std::optional<at::Layout> /*layout*/,
                 std::optional<at::Device> device, std::optional<bool> /*pin_memory*/,
                 std::optional<at::MemoryFormat> memory_format) {
  c10::OptionalDeviceGuard guard(device);
  return at::detail::empty_generic(size, &device_allocator, key_set(), c10::dtype_or_default(dtype),
                                   memory_format);
}

at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride, std::optional<at::ScalarType> dtype,
                         std::optional<at::Layout> /*layout*/, std::optional<at::Device> device,
                         std::optional<bool> /*pin_memory*/) {
  c10::OptionalDeviceGuard guard(device);
  return at::detail::empty_strided_generic(size, stride, &device_allocator, key_set(),
                                           c10::dtype_or_default(dtype));
}

// A CPU view of a tdev tensor's memory, for copies only.
at::Tensor host_view(const at::Tensor& t) {
  if (t.device().type() != kType) return t;
  return at::from_blob(t.data_ptr(), t.sizes(), t.strides(), t.options().device(c10::DeviceType::CPU));
}

at::Tensor copy_from(const at::Tensor& self, const at::Tensor& dst, bool /*non_blocking*/) {
  TORCH_CHECK(self.device().type() == kType || dst.device().type() == kType, "tdev: copy between ",
              self.device(), " and ", dst.device());
  TORCH_CHECK(self.is_cpu() || self.device().type() == kType, "tdev: cannot copy from ", self.device());
  TORCH_CHECK(dst.is_cpu() || dst.device().type() == kType, "tdev: cannot copy to ", dst.device());
  if (dst.numel() == 0) return dst;
  host_view(dst).copy_(host_view(self));
  return dst;
}

at::Tensor copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  at::native::resize_(dst, self.sizes(), std::nullopt);
  return copy_from(self, dst, false);
}

at::Scalar local_scalar_dense(const at::Tensor& self) { return at::_local_scalar_dense(host_view(self)); }

const at::Tensor& resize(const at::Tensor& self, c10::SymIntArrayRef size,
                         std::optional<at::MemoryFormat> memory_format) {
  return at::native::resize_(self, C10_AS_INTARRAYREF_SLOW(size), memory_format);
}

at::Tensor& set_storage(at::Tensor& self, c10::Storage source, int64_t offset, c10::IntArrayRef size,
                        c10::IntArrayRef stride) {
  return at::native::set_storage_cpu_(self, source, offset, size, stride);
}

at::Tensor& set_source_storage(at::Tensor& self, c10::Storage source) {
  int64_t numel = static_cast<int64_t>(source.nbytes() / self.dtype().itemsize());
  return set_storage(self, source, 0, {numel}, {});
}

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("empty.memory_format", empty);
  m.impl("empty_strided", empty_strided);
  m.impl("_copy_from", copy_from);
  m.impl("_copy_from_and_resize", copy_from_and_resize);
  m.impl("_local_scalar_dense", local_scalar_dense);
  m.impl("resize_", resize);
  m.impl("set_.source_Storage", set_source_storage);
  m.impl("set_.source_Storage_storage_offset", set_storage);
  m.impl("as_strided", at::native::as_strided_tensorimpl);
  m.impl("view", at::native::view);
  m.impl("_reshape_alias", at::native::_reshape_alias);
  m.impl("unfold", at::native::unfold);
}

// Every other op: the CPU kernel, with tdev generators swapped for their CPU state so that
// random ops draw from the device's own generator.
void fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& args = op.schema().arguments();
  const size_t base = stack->size() - args.size();
  for (size_t i = 0; i < args.size(); ++i) {
    auto type = args[i].type();
    if (auto opt = type->cast<c10::OptionalType>()) type = opt->getElementType();
    if (type->kind() != c10::TypeKind::GeneratorType) continue;
    c10::IValue& value = (*stack)[base + i];
    std::optional<at::Generator> gen;
    if (value.isGenerator()) {
      gen = value.toGenerator();
    } else {  // no generator given: the default one of the device the op's tensors are on
      for (size_t j = base; j < stack->size(); ++j) {
        const c10::IValue& v = (*stack)[j];
        if (v.isTensor() && v.toTensor().device().type() == kType) {
          gen = default_generator(v.toTensor().device().index());
          break;
        }
      }
    }
    if (gen && gen->device().type() == kType) {
      value = c10::IValue(static_cast<Generator*>(gen->unsafeGetGeneratorImpl())->cpu);
    }
  }
  at::native::cpu_fallback(op, stack, /*error_on_views=*/true);
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) { m.fallback(torch::CppFunction::makeFromBoxedFunction<&fallback>()); }

// ---- autocast: the lower-precision and fp32 op lists PyTorch publishes for backends ----------

#define TDEV_LOWER(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, lower_precision_fp)
#define TDEV_FP32(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32)

TORCH_LIBRARY_IMPL(_, AutocastPrivateUse1, m) { m.fallback(torch::CppFunction::makeFallthrough()); }

TORCH_LIBRARY_IMPL(aten, AutocastPrivateUse1, m) {
  AT_FORALL_LOWER_PRECISION_FP(TDEV_LOWER)
  AT_FORALL_FP32(TDEV_FP32)
}

}  // namespace tdev

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("device_count", [] { return static_cast<int>(tdev::device_count()); });
  m.def("current_device", [] { return static_cast<int>(tdev::current_index); });
  m.def("set_device", [](int index) {
    tdev::check_index(static_cast<c10::DeviceIndex>(index));
    tdev::current_index = static_cast<c10::DeviceIndex>(index);
  });
  m.def("pinned_supported", &tdev::pinned_supported);
  m.def("default_generator", [](int index) {
    return py::reinterpret_steal<py::object>(
        THPGenerator_initDefaultGenerator(tdev::default_generator(static_cast<c10::DeviceIndex>(index))));
  });
}
